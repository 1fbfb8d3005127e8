# loopback.py — token-exact chat sessions, and the OpenAI / Anthropic wire server that wraps them.
#
# Owns: `ChatSession`, one per rollout, which turns a chat request (a message list) into engine prompt
# ids, generates, and commits the turn to the rollout's TokenLedger (returning a `wires.ChatTurn`); the
# Hermes/Qwen `<tool_call>` parser that gives the reply its structure; `LoopbackServer`.
#
# Keeps invariant 1 (token identity) for agents that only speak text. An agent echoes the assistant's
# reply back as *text*; rendering that text again and re-encoding it would not give back the sampled ids
# (BPE splits are many-to-one, tool JSON is re-serialized, templates strip <think>). So a new request
# that only appends messages (the three checks of `_delta_text`) is served as: the ledger's exact tokens + the
# encoded *delta* text, which always extends the open segment. Anything else (edited history, a template that
# rewrote an earlier turn, compaction) is rendered and encoded whole. Whether a turn seals is then decided by
# the ledger alone, from ids and images, never from text: `TokenLedger.extend_or_seal` seals exactly when the
# open segment's token ids are not a prefix of the new prompt's ids, or its images are not the first images of
# the new prompt (the same objects; a session processes each image URL once, so an unchanged image is the same
# object). A whole re-encoding whose ids still begin with every recorded id extends; one that differs at any
# recorded position seals. An MoE turn sampled at a new policy version seals too, after its prompt extended (the
# ledger's route_version: its routes at the recorded positions are the new weights'), and `ChatTurn.extended` stays
# the prompt's answer.
# A turn is committed only after generation succeeds (a turn recorded before a failed generation would leave
# context with no reply, and the retry would append a second copy); the sampled text is never re-encoded.
# A retried request (identical messages, tools, sampling and turn options to the last one) is answered from the
# record: the same ChatTurn again, nothing generated, nothing appended (a client retry must not sample twice).
# Tool choice (wires.TurnOptions): a forced call (required / named) has the session write '<tool_call>\n' after the
# generation prompt on the model's behalf — context in the record, never trainable — and the sampling carries the
# tools' grammar for the text after it; the reply the agent reads, and the text its echo must open with, include
# that opening, so an echo still extends the record bitwise. 'none' keeps the tools in the prompt (so the next
# turn extends), never parses a call out of the reply, and bans a one-token '<tool_call>' with a -inf logit bias,
# recorded in the sampling. Without parallel calls sampling ends at the first '</tool_call>', a stop string whose
# text is kept (the tokens that wrote it are sampled and trainable, as a stop token is). A response format (a JSON
# grammar) with tools offered under 'auto' shapes the final message only, as on OpenAI: the sampling carries
# constraints.with_tool_calls, its JSON or tool calls, the '<tool_call>' opening sampled by the model (trainable);
# a forced call outranks the format (the tools' grammar replaces it).
#
# `LoopbackServer` serves ChatSessions over HTTP, one session per rollout under /s/<id>/v1 with its own
# key: OpenAI chat completions and Anthropic messages (streaming or not) both decode (wires.py) to the
# same canonical messages and go through the same ChatSession.turn, so token accounting does not depend on
# the wire. A session's key reaches only its own session's routes. Opening (POST /sessions) and closing (DELETE
# /s/<id>) a session over HTTP is the operator's act, done with the server's admin key (made per server, or the
# operator's); a session's key is refused there, so an agent holding one cannot sample the policy outside its
# rollout. The admin key never reaches an agent (a ChatContext carries its session's URL and key only).
# Bad input is refused with a 4xx in the wire's own format before anything reaches the session, so nothing is
# recorded; every error page (aiohttp's own 404, 405 and parse errors included) is that JSON.
# Work is bounded before it is done: the body's size and the time it may take to arrive, a prompt's text
# against the context before it is rendered, an image's pixels from its header before it is decoded (per image and
# per request); sessions opened over HTTP expire when idle and are capped. Cheap clients are bounded too: a
# connection must send each request head within idle_timeout_s (slowloris) and is closed when idle that long; past
# max_connections the oldest idle one is closed. A session's HTTP turns run one at a time, and the ones waiting hold
# no worker thread: one session's backlog delays another session's turn by at most the one turn it is generating
# (they share the engine's batch), and past max_session_requests waiting or generating it gets a 429 with a
# Retry-After. A request whose client hangs up while it waits is dropped, never generated; no header value (a key)
# is ever logged or quoted in an error page.
# Text is text: a special-token string inside a message reaches the model as characters (data.encode_text).
# Streaming sends each token's text as it is sampled; a client that disconnects
# mid-turn does not stop the turn, which commits, so a retry fetches it. Images reach a VLM processed
# once per session, their pads expanded, and recorded with the row. Standalone (`python loopback.py
# --model ...`) it serves one model behind an EmbeddedEngine and opens sessions on `POST /sessions` (with the admin
# key it prints at start, or the operator's from TRACERL_LOOPBACK_ADMIN_KEY), so an agent author can check token
# capture before training (`GET /s/<id>/view`: the session's tokens as viewer.py's page). Never: computes rewards or
# trains.
from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import hmac
import io
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import torch
from aiohttp import web, web_protocol
from jinja2 import TemplateError
from PIL import Image

import constraints
import data
import invariants
import models
import viewer
import wires
from rollout import EmbeddedEngine, Generation, SamplingParams, find_stop
from router import EngineFailure, Router

log = logging.getLogger("tracerl.loopback")


# ---- tool calls: read structure out of the sampled text, never write it back ------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPENING, CALL_CLOSING = "<tool_call>\n", "</tool_call>"    # a forced call's opening; where one call ends


def _call_arguments(call: dict) -> dict | None:
    """A call's arguments as an object: absent means {}; a JSON string holding an object (the way the OpenAI
    wire carries them, and how some models write them) is that object; anything else is not a call."""
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
            wires.check_json(arguments, "a tool call's arguments")
        except (ValueError, RecursionError, wires.WireError):
            return None
    return arguments if isinstance(arguments, dict) else None


def parse_hermes_tool_calls(text: str, call_prefix: str) -> dict:
    """Hermes/Qwen style: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an
    OpenAI-shaped tool call. A block that is not valid JSON with a string name and object arguments stays in
    the content as text: the model's error is shown to the agent, never repaired. The token record is not
    touched."""
    calls, kept = [], []
    last = 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            wires.check_json(call, "a tool call")     # a reply is answered as JSON: it must re-serialize
        except (ValueError, RecursionError, wires.WireError):
            continue
        arguments = _call_arguments(call) if isinstance(call, dict) and isinstance(call.get("name"), str) else None
        if arguments is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"{call_prefix}-{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    if not calls:       # the reply is returned byte for byte, so an echo of it extends the record
        return {"role": "assistant", "content": text}
    kept.append(text[last:])
    # only trailing whitespace goes (the template writes its own separator before a call); the start is kept
    content = "".join(kept).rstrip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


def reply_text(tokenizer, gen: Generation, stops: tuple[str, ...]) -> str:
    """The reply as the agent reads it: the sampled ids decoded (special tokens skipped), cut before the agent's
    stop string that ended it (OpenAI and Anthropic both leave it out; a stop the session added is kept)."""
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    hit = find_stop(text, (gen.stop_string,)) if gen.stop_string in stops else None
    return text[:hit[0]] if hit else text


# ---- images: bounded from their headers before anything is decoded -------------------------------
# A PNG of a few KB can hold gigapixels (a 27.6 KB 13000x13000 1-bit one took 1.8 GB to serve). The pixels an image
# will decode to are read from its header first (PIL opens lazily) and refused over these bounds; PIL's own
# DecompressionBombError (at twice Image.MAX_IMAGE_PIXELS) stays the backstop inside data.decode_image.
MAX_IMAGE_PIXELS = 4096 * 4096            # one image; above Qwen2-VL's processor max_pixels (12,845,056)
MAX_REQUEST_IMAGE_PIXELS = 4 * MAX_IMAGE_PIXELS   # every image a request brings that is not decoded yet, together


def header_size(url) -> tuple[int, int]:
    """(width, height) from an image data URL's header, nothing decoded; (0, 0) for a URL or bytes that are no image
    (data.decode_image refuses those with its own message)."""
    if not isinstance(url, str):
        return 0, 0                       # a PIL image of the caller's own, already decoded
    try:
        with Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2], validate=True))) as image:
            return image.size
    except Image.DecompressionBombError as error:     # over PIL's own limit, far over ours
        raise ValueError(f"an image is far over this server's limit of {MAX_IMAGE_PIXELS:,} pixels ({error}); "
                         "send it scaled down") from None
    except (ValueError, OSError):         # binascii.Error is a ValueError
        return 0, 0


class ChatSession:
    """One rollout's conversation with the engine, token-exact across turns."""

    def __init__(self, engine, tokenizer, rollout_id: str, group_id: str = "", template: str | None = None,
                 sampling: SamplingParams | None = None, max_length: int = 4096, image_processor=None):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.sampling = sampling or SamplingParams()
        self.max_length = max_length
        self.image_processor = image_processor  # None: a text-only model, and image parts are refused
        # Each picture is processed once per session, so one that comes back in the history is the same
        # ImageInput object: that is how the ledger tells an unchanged image from a changed one.
        self._images: dict[str, invariants.ImageInput] = {}
        self.ledger = invariants.TokenLedger(rollout_id, group_id)
        self.lock = threading.Lock()           # one turn at a time per session
        self.ledger_lock = threading.Lock()    # held only while a turn commits: the trace never waits on a generation
        # What the next request must start with to count as an extension: the last request's messages
        # plus the reply as we returned it, and their rendering up to the generation prompt.
        self._expected: list[dict] | None = None
        self._expected_prompt_text = ""
        self._echo_text = ""                   # how the last reply must open its echoed assistant block
        self.turns = 0                         # generations committed to the ledger
        self.max_tokens_turns = 0                 # of those, replies that hit max_tokens before a stop token
        self.generations: list[Generation] = []  # the engine's output of every committed turn, in order: the
                                               # run-time check that the ledger trains each sampled token once
        self.image_pad_turns = 0               # of those, replies in which a VLM sampled its image placeholder:
                                               # no image fills that pad, so the row cannot be trained on
        self._last_request: tuple | None = None   # (messages, tools, sampling, options) of the last committed turn
        self._last_turn: wires.ChatTurn | None = None
        self.last_used = time.monotonic()      # when a turn last started or ended (idle sessions may expire)

    def turn(self, messages: list[dict], tools: list[dict] | None = None, sampling: SamplingParams | None = None,
             on_token: Callable[[list[int], int], None] | None = None,
             options: wires.TurnOptions | None = None) -> wires.ChatTurn:
        """Generate the assistant's reply to `messages` and commit it. `on_token(prompt_ids, token_id)` is
        called as each token is sampled (a streaming server's hook); a retry answered from the record never
        calls it. `options`: the tool choice and the chat template's switches (default: auto, none)."""
        params, options = sampling or self.sampling, options or wires.TurnOptions()
        with self.lock:
            self.last_used = time.monotonic()
            if self._last_request == (messages, tools, params, options):   # a retry: answer from the record
                return self._last_turn
            # copied before anything commits
            request = (copy.deepcopy(messages), copy.deepcopy(tools), params, copy.deepcopy(options))
            turn = self._generate_and_commit(messages, tools, params, options, on_token)
            self._last_request, self._last_turn = request, turn
            self.last_used = time.monotonic()
            return turn

    def _generate_and_commit(self, messages: list[dict], tools, params: SamplingParams, options: wires.TurnOptions,
                             on_token) -> wires.ChatTurn:
        """Generate, build the reply, then commit. Nothing that can fail runs after the ledger changes: a client
        answered with an error must find the session as it was, or its retry would sample the turn twice."""
        self._bound_prompt(messages, tools)
        opening = CALL_OPENING if options.tool_choice in ("required", "named") else ""
        prompt_ids, images, prompt_text = self._prompt(messages, tools, options.template_kwargs, opening)
        room = self.max_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt holds {len(prompt_ids)} tokens, at or over the session's context "
                             f"of {self.max_length}; shorten the conversation")
        relay = None if on_token is None else (lambda _, token_id: on_token(prompt_ids, token_id))
        # a Router sends every turn of the session to the engine that holds its prefix
        sticky = {"session_ids": [self.ledger.rollout_id]} if isinstance(self.engine, Router) else {}
        engine_params = replace(self._tool_sampling(params, tools, options), max_tokens=min(params.max_tokens, room))
        gen = self.engine.generate([prompt_ids], engine_params, relay, images=[images] if images else None,
                                   **sticky)[0]
        text = opening + reply_text(self.tokenizer, gen, params.stop)
        message = {"role": "assistant", "content": text} if options.tool_choice == "none" else \
            parse_hermes_tool_calls(text, f"call-{self.ledger.rollout_id}-{self.turns}")
        # An echo must open with the reply as sampled, stop token included ("...<|im_end|>"), after the opening the
        # session forced. A reply cut at the agent's stop string opens with the text the agent got: the record keeps
        # the ids that wrote the stop string (the model did write them) and the template's closing follows them as
        # context.
        stop_sequence = gen.stop_string if gen.stop_string in params.stop else None
        echo_text = text if stop_sequence else \
            opening + self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        sampled_pad = self.image_processor is not None and \
            self.tokenizer.convert_tokens_to_ids(data.IMAGE_PAD) in gen.token_ids
        # commit: only now does the ledger change (a failed generate leaves the session as it was)
        with self.ledger_lock:
            extended = self.ledger.extend_or_seal(gen.prompt_ids, images)   # the ledger's answer, not the text's
            self.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling,
                                       routed=gen.routes is not None)
            if gen.routes is not None:
                self.ledger.absorb_routes(gen.routes)
            self.generations.append(gen)
        self.turns += 1
        self.max_tokens_turns += gen.finish_reason == "length"
        self.image_pad_turns += sampled_pad
        self._expected = [*messages, message]
        self._expected_prompt_text = prompt_text
        self._echo_text = echo_text
        return wires.ChatTurn(message, gen, extended, stop_sequence)

    def _tool_sampling(self, params: SamplingParams, tools, options: wires.TurnOptions) -> SamplingParams:
        """The request's sampling with what its tool choice asks of the engine: 'none' bans a one-token '<tool_call>'
        (a -inf logit bias, recorded per token like any bias); 'auto' with tools lets a response format's grammar
        take tool calls instead; no parallel calls stop at the first '</tool_call>'."""
        if options.tool_choice == "auto" and tools and params.constraint is not None:
            params = replace(params, constraint=constraints.with_tool_calls(params.constraint, tools,
                                                                            options.parallel_tool_calls))
        if options.tool_choice == "none":
            opening = self.tokenizer.encode(CALL_OPENING.strip(), add_special_tokens=False)
            if len(opening) == 1:
                bias = {**dict(params.logit_bias), opening[0]: -math.inf}
                params = replace(params, logit_bias=tuple(sorted(bias.items())))
        if not options.parallel_tool_calls and CALL_CLOSING not in params.stop:
            params = replace(params, stop=(*params.stop, CALL_CLOSING))
        return params

    def _bound_prompt(self, messages: list[dict], tools) -> None:
        """Refuse a request whose text cannot fit the context before rendering or encoding any of it: no token
        spans more characters than the longest vocabulary entry, so more characters than max_length times that
        can only be more than max_length tokens. (A 20 MB message would otherwise be encoded in full first.)"""
        chars = _text_chars(messages) + _text_chars(tools)
        limit = self.max_length * data.longest_token_chars(self.tokenizer)
        if chars > limit:
            raise ValueError(f"the request holds {chars} characters of text, more than a context of "
                             f"{self.max_length} tokens can hold (at most {limit}); shorten the conversation")

    def _render(self, messages, tools, generation_prompt: bool, template_kwargs: dict | None) -> str:
        return data.render_prompt_text(self.tokenizer, messages, tools, self.template, generation_prompt,
                                       template_kwargs)

    def _prompt(self, messages: list[dict], tools, template_kwargs: dict | None = None,
                opening: str = "") -> tuple[list[int], list[invariants.ImageInput], str]:
        """The engine prompt for this request (ids, and every image its pads stand for) and the request rendered
        up to the generation prompt. When the request only appends messages, the prompt is the record's exact
        tokens plus the new messages encoded (and only their images are new); otherwise it is encoded whole,
        and the ledger will seal. `opening` (a forced call's) is written after the generation prompt, as context."""
        images = self._prompt_images(messages)
        full = self._render(messages, tools, True, template_kwargs)
        delta = self._delta_text(messages, tools, full, template_kwargs)
        if delta is None:
            return self._encode(full + opening, images), images, full
        fresh = images[len(self.ledger.open_images):]
        return self.ledger.open_token_ids + self._encode(delta + opening, fresh), images, full

    def _prompt_images(self, messages: list[dict]) -> list[invariants.ImageInput]:
        urls = data.prompt_images(messages)
        if urls and self.image_processor is None:
            raise ValueError("this model is text-only (it has no image processor); remove the image parts")
        new = list(dict.fromkeys(url for url in urls if url not in self._images))
        sizes = [header_size(url) for url in new]       # every bound is checked before the first image decodes
        pixels = [width * height for width, height in sizes]
        for k, ((width, height), n) in enumerate(zip(sizes, pixels)):
            if n > MAX_IMAGE_PIXELS:
                raise ValueError(f"new image {k + 1} of this request is {width}x{height} = {n:,} pixels, over this "
                                 f"server's limit of {MAX_IMAGE_PIXELS:,} per image; send it scaled down")
        if sum(pixels) > MAX_REQUEST_IMAGE_PIXELS:
            raise ValueError(f"this request's {len(new)} new images hold {sum(pixels):,} pixels, over this server's "
                             f"limit of {MAX_REQUEST_IMAGE_PIXELS:,} per request; send fewer or smaller images")
        for url in new:
            self._images[url] = data.image_inputs(self.image_processor, [url])[0]
        return [self._images[url] for url in urls]

    def _encode(self, text: str, images: list[invariants.ImageInput]) -> list[int]:
        """Encode rendered text once (the messages' text as text, data.encode_text); for a VLM each image's single
        pad becomes its run of n_tokens pads."""
        ids = data.encode_text(self.tokenizer, text)
        if self.image_processor is None:
            return ids
        return data.expand_image_pads(ids, images, self.tokenizer.convert_tokens_to_ids(data.IMAGE_PAD))

    def _delta_text(self, messages, tools, full: str, template_kwargs: dict | None = None) -> str | None:
        """Text to append after the record's exact tokens, or None when this request is not an append.
        Three checks, each of which must hold: (1) the messages start with the last request plus our
        reply, unedited; (2) rendering that prefix is a string prefix of the new rendering (a template
        that strips earlier <think> fails here); (3) the prefix's assistant block starts with exactly the
        reply as sampled (re-serialized tool JSON fails here). What the template writes after the sampled text
        (the '\\n' after <|im_end|>, or a closing <|im_end|> when the reply hit max_tokens or a stop string)
        is context. The prefix is rendered with this request's tools and template switches: a change to either that
        rewrites the record's text fails (2)."""
        if self._expected is None or messages[:len(self._expected)] != self._expected:
            return None
        prefix = self._render(self._expected, tools, False, template_kwargs)
        if not full.startswith(prefix) or not prefix.startswith(self._expected_prompt_text):
            return None
        assistant_block = prefix[len(self._expected_prompt_text):]
        if not assistant_block.startswith(self._echo_text):
            return None
        return assistant_block[len(self._echo_text):] + full[len(prefix):]


def _text_chars(value) -> int:
    """Characters in every string of a JSON-like value (the wires bound its depth)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(k) + _text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


def session_trace(session: ChatSession, tokenizer) -> dict:
    """The session's ledger as JSON: what the trainer will see, token by token. Each token's sampling is an index
    into `samplings` (what was enforced: greedy, a bias or ban, penalties, a grammar; the first entry is context's)."""
    samplings: dict[invariants.Sampling, int] = {invariants.UNSAMPLED: 0}
    with session.ledger_lock:
        segments = [{"segment_id": s.segment_id, "token_ids": s.token_ids,
                     "tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in s.token_ids],
                     "trainable": s.trainable, "behavior_logprobs": s.behavior_logprobs,
                     "sampling": [samplings.setdefault(x, len(samplings)) for x in s.sampling],
                     "policy_versions": s.policy_versions, "seal_reason": s.seal_reason,
                     "common_prefix_len": s.common_prefix_len,
                     "images": [{"grid_thw": image.grid_thw, "n_tokens": image.n_tokens} for image in s.images]}
                    for s in session.ledger.segments]
    return {"rollout_id": session.ledger.rollout_id, "group_id": session.ledger.group_id, "segments": segments,
            "samplings": [wires.sampling_json(x) for x in samplings]}


# ---- the server ---------------------------------------------------------------------------------

@dataclass
class SessionInfo:
    session_id: str
    api_key: str                   # send as `Authorization: Bearer <key>` (OpenAI) or `x-api-key` (Anthropic)
    base_url: str                  # http://HOST:PORT/s/<id>/v1 — OpenAI(base_url=...)
    session_url: str               # http://HOST:PORT/s/<id> — Anthropic(base_url=...); DELETE it (admin key) to close
    trace_url: str                 # http://HOST:PORT/s/<id>/trace — the session's segments, token by token
    view_url: str                  # http://HOST:PORT/s/<id>/view — the same, as a page (viewer.py)


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
    """Which wire's error format a request gets: Anthropic's on its messages route, OpenAI's everywhere else."""
    return "anthropic" if request.path.endswith("/v1/messages") else "openai"


def _error_response(wire: str, error: wires.WireError, headers=None) -> web.Response:
    return web.json_response(error.body(wire), status=error.status, headers=headers)


# Headers, not only bodies, are parsed into log lines and error pages: no header value is ever logged or echoed
# (a malformed `Authorization` line would carry the session's key), so the access log has no header field.
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf'


@dataclass
class _Lane:
    """Where a session's HTTP turns wait for the one before them."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)   # waiting here holds no worker thread
    in_flight: int = 0             # HTTP turns waiting or generating (capped: max_session_requests)


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
    """OpenAI and Anthropic HTTP wires over ChatSessions, on an aiohttp loop in a background thread.
    engine.generate runs in a thread pool, so the loop keeps serving other sessions while one generates.
    Concurrent sessions' turns share the engine's batch (EmbeddedEngine batches concurrent callers)."""

    def __init__(self, engine, tokenizer, template: str | None = None, model_name: str = "policy",
                 host: str = "127.0.0.1", port: int = 0, max_length: int = 4096, image_processor=None,
                 body_timeout_s: float = 60.0, session_ttl_s: float = 3600.0, max_open_sessions: int = 1024,
                 idle_timeout_s: float = 30.0, max_connections: int = 512, max_session_requests: int = 8,
                 admin_key: str | None = None):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        # Opening and closing sessions over HTTP needs this key: the operator's, or one made here for this server alone
        # (its owner reads it from .admin_key). It is no session's key, and no agent is handed it.
        if admin_key is not None and not admin_key_is_valid(admin_key):
            raise ValueError(ADMIN_KEY_RULE)
        self.admin_key = admin_key or f"sk-loopback-admin-{secrets.token_urlsafe(32)}"
        self.image_processor = image_processor     # a VLM's (models.load_image_processor); None = text only
        self.model_name, self.host, self.port = model_name, host, port
        self.max_length = max_length               # context of a session that does not ask for less
        self.body_timeout_s = body_timeout_s       # a request body that takes longer to arrive is refused (408)
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
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="loopback-trace")   # never behind turns
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
                       max_length: int | None = None) -> SessionInfo:
        """Open a session for its caller, who closes it (close_session hands back its ledger); it never expires."""
        return self._new_session(rollout_id, group_id, sampling, max_length, over_http=False)

    def _new_session(self, rollout_id: str | None, group_id: str, sampling: SamplingParams | None,
                     max_length: int | None, over_http: bool) -> SessionInfo:
        if self._thread is None:
            raise RuntimeError("start() the server before creating sessions: their URLs carry the bound port")
        session_id = secrets.token_hex(8)
        api_key = f"sk-loopback-{secrets.token_urlsafe(24)}"
        session = ChatSession(self.engine, self.tokenizer, rollout_id or session_id, group_id, self.template,
                              sampling, max_length or self.max_length, self.image_processor)
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

    async def _body(self, request: web.Request, optional: bool = False) -> dict:
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
        return wires.parse_body(raw)

    @staticmethod
    def _abandon_body(request: web.Request) -> None:
        """Give up on the rest of a body that stalled or cannot be decoded: mark it ended, so aiohttp does not
        wait for (or re-raise on) it after the reply, and have the reply close the connection."""
        request.content.feed_eof()
        request[BODY_ABANDONED] = True

    async def _turn(self, session: ChatSession, lane: _Lane, request: wires.WireRequest,
                    on_token=None) -> wires.ChatTurn:
        """One turn of the session, after the ones before it. Over max_session_requests waiting or generating, a 429.
        A client that hangs up while its turn waits cancels it (nothing generated); one that hangs up while it
        generates does not: the turn commits, a retry gets it from the record, and the next waits until it has."""
        if lane.in_flight >= self.max_session_requests:
            raise wires.WireError(429, f"this session already has {lane.in_flight} requests waiting or generating, "
                                       f"this server's limit (its turns run one at a time); retry when one is "
                                       f"answered", "rate_limit_error")
        lane.in_flight += 1
        try:
            async with lane.lock:
                generating = asyncio.get_running_loop().run_in_executor(
                    self._executor, session.turn, request.messages, request.tools, request.sampling, on_token,
                    request.options)
                try:
                    return await asyncio.shield(generating)
                except asyncio.CancelledError:
                    await asyncio.wait([generating])      # the lane stays held until the turn has committed
                    raise
        except (ValueError, TemplateError) as error:   # an overlong prompt, a bad image, a template that refuses
            raise wires.WireError(400, str(error)) from None
        finally:
            lane.in_flight -= 1

    async def _stream(self, request: web.Request, session: ChatSession, lane: _Lane,
                      wire_request: wires.WireRequest,
                      stream: wires.OpenAIStream | wires.AnthropicStream) -> web.StreamResponse:
        """Serve one turn as server-sent events, text sent as its tokens are sampled. Nothing is sent before
        the first token, so a request refused by the session is still a plain 4xx. A client that hangs up
        does not stop the turn: it is committed, and a retry gets it from the record."""
        loop = asyncio.get_running_loop()
        sampled: asyncio.Queue = asyncio.Queue()

        def on_token(prompt_ids: list[int], token_id: int) -> None:     # runs on the engine's thread
            loop.call_soon_threadsafe(sampled.put_nowait, (prompt_ids, token_id))

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
                prompt_ids, token_id = arrival.result()
                if response is None:
                    response = await self._open_stream(request, stream.start(prompt_ids))
                if piece := live.push(token_id):
                    await self._send(response, stream.text(piece))
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
                await self._send(response, [("error", error.body(stream.wire))])
                return response
            if response is None:          # a retry answered from the record: no token was sampled live
                response = await self._open_stream(request, stream.start(turn.generation.prompt_ids))
            await self._send(response, stream.finish(turn, live.rest(turn.message["content"])))
            if stream.done_marker:
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:      # the client hung up; the turn still commits and a retry returns it
            pass
        except asyncio.CancelledError:    # the client hung up (handler cancellation): a turn still waiting leaves
            job.cancel()
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
        wire_request = wires.decode_openai(await self._body(request), session.sampling)
        reply_id = f"chatcmpl-{secrets.token_hex(8)}"
        if wire_request.stream:
            stream = wires.OpenAIStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, lane, wire_request, stream)
        turn = await self._turn(session, lane, wire_request)
        return web.json_response(wires.openai_reply(turn, wire_request, self.tokenizer, self.model_name, reply_id))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session, lane = self._authorize(request)
        wire_request = wires.decode_anthropic(await self._body(request), session.sampling)
        reply_id = f"msg_{secrets.token_hex(12)}"
        if wire_request.stream:
            stream = wires.AnthropicStream(wire_request, self.tokenizer, self.model_name, reply_id)
            return await self._stream(request, session, lane, wire_request, stream)
        turn = await self._turn(session, lane, wire_request)
        return web.json_response(wires.anthropic_reply(turn, wire_request, self.model_name, reply_id))

    async def _trace(self, request: web.Request) -> web.Response:
        session = self._authorize(request)[0]
        trace = await asyncio.get_running_loop().run_in_executor(self._reads, session_trace, session, self.tokenizer)
        return web.json_response(trace)

    async def _view(self, request: web.Request) -> web.Response:
        """GET /s/<id>/view (the session's key, as for its trace): the trace as viewer.py's page, every token of
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
        sampling = wires.sampling_from(SamplingParams(), temperature=wires.number_field(body, "temperature"),
                                       max_tokens=wires.number_field(body, "max_tokens", integer=True))
        return web.json_response(asdict(self._new_session(None, "", sampling, max_length, over_http=True)))

    async def _close(self, request: web.Request) -> web.Response:
        """DELETE /s/<id> (the admin key: a session's own key can no more close a session than open one)."""
        self._authorize_admin(request)
        try:
            self.close_session(request.match_info["sid"])
        except KeyError:                  # never opened, expired, or closed already
            raise wires.WireError(404, f"no open session {request.match_info['sid']!r} on this server",
                                  "not_found_error") from None
        return web.json_response({"session_id": request.match_info["sid"], "closed": True})


# ---- standalone: serve one model until interrupted ---------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(
        description="Serve a model on token-exact OpenAI and Anthropic wires. Open a session with "
                    "`POST /sessions` and the admin key, point an SDK at its base_url with its api_key, read what the "
                    "trainer would see at its trace_url (as a page at <session_url>/view), close it with "
                    "`DELETE /s/<id>` and the admin key.")
    parser.add_argument("--model", required=True, help="a model folder, or one of " + ", ".join(models.MODEL_NAMES))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--template", choices=["chatml", "model"], default="model",
                        help="chat template: the model's own (default) or tracerl's ChatML")
    parser.add_argument("--max-length", type=int, default=4096, help="most tokens a session's context may hold")
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
    server = LoopbackServer(engine, tokenizer, template, args.model, args.host, args.port, args.max_length,
                            models.load_image_processor(path), admin_key=args.admin_key)
    port = server.start()
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
