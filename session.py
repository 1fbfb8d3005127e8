# session.py — one rollout's token-exact chat session: messages in, the sampled reply out, the ledger kept.
#
# Owns: `ChatSession`, one per rollout, which turns a chat request (a message list) into engine prompt
# ids, generates, and commits the turn to the rollout's TokenLedger (returning a `wires.ChatTurn`); the
# Hermes/Qwen `<tool_call>` parser that gives the reply its structure (a call's id is the turn's prefix and its
# block's ordinal, so a streaming wire can name a call before its block is whole); the image bounds read from
# headers; the session's trace (what the trainer will see, token by token, and what each turn's prefill computed and
# took from the engine's prefix cache: the cost of a long episode). loopback.py serves these sessions over HTTP.
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
# The context: a prompt that leaves no room for a reply in max_length (at most the engine's max_model_len, the
# model's position limit, and so by default) raises ContextOverflow, before anything is generated or recorded; a reply
# takes at most the rest of the context, and a session's default sampling lets it take all of it.
# Text is text: a special-token string inside a message reaches the model as characters (data.encode_text).
# Images reach a VLM processed once per session, their pads expanded, and recorded with the row. Never: speaks
# HTTP, computes rewards or trains.
from __future__ import annotations

import base64
import copy
import io
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from PIL import Image

import constraints
import data
import invariants
import wires
from rollout import Generation, SamplingParams, find_stop
from router import Router


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


def tool_call_blocks(text: str) -> Iterator[tuple[int, re.Match, dict | None]]:
    """Each `<tool_call>...</tool_call>` block of a reply in order: its ordinal, its match, and its call {"name",
    "arguments"}, or None when it is not one (not valid JSON with a string name and object arguments)."""
    for ordinal, match in enumerate(TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
            wires.check_json(call, "a tool call")     # a reply is answered as JSON: it must re-serialize
        except (ValueError, RecursionError, wires.WireError):
            yield ordinal, match, None
            continue
        arguments = _call_arguments(call) if isinstance(call, dict) and isinstance(call.get("name"), str) else None
        yield ordinal, match, None if arguments is None else {"name": call["name"], "arguments": arguments}


def parse_hermes_tool_calls(text: str, call_prefix: str) -> dict:
    """Hermes/Qwen style: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an
    OpenAI-shaped tool call, its id the prefix and the block's ordinal (a streaming wire names a call by it before
    the block is whole). A block that is not valid JSON with a string name and object arguments stays in
    the content as text: the model's error is shown to the agent, never repaired. The token record is not
    touched."""
    calls, kept = [], []
    last = 0
    for ordinal, match, call in tool_call_blocks(text):
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"{call_prefix}-{ordinal}", "type": "function", "function": call})
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


# ---- the context: a prompt over it is refused, never cut ----------------------------------------

class ContextOverflow(ValueError):
    """A prompt that leaves no room for a reply in the session's context. The server answers it in each wire's own
    words (wires.ContextLengthExceeded), which a harness recognises and compacts its conversation on."""

    def __init__(self, prompt_tokens: int, context: int, message: str):
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context   # the prompt (or a lower bound on it), the context


class ChatSession:
    """One rollout's conversation with the engine, token-exact across turns. `max_length`: the context, prompt and
    reply (default: the most the engine serves, its model's position limit); `sampling`: the defaults a request
    overrides (default: a reply may take the rest of the context)."""

    def __init__(self, engine, tokenizer, rollout_id: str, group_id: str = "", template: str | None = None,
                 sampling: SamplingParams | None = None, max_length: int | None = None, image_processor=None):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.max_length = max_length or engine.max_model_len
        if not 1 < self.max_length <= engine.max_model_len:
            raise ValueError(f"a session's context of {self.max_length} tokens must be in [2, {engine.max_model_len}], "
                             f"the most the engine serves (its model's position limit)")
        self.sampling = sampling or SamplingParams(max_tokens=self.max_length)
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
             on_token: Callable[[list[int], int, str], None] | None = None,
             options: wires.TurnOptions | None = None) -> wires.ChatTurn:
        """Generate the assistant's reply to `messages` and commit it. `on_token(prompt_ids, token_id, call_prefix)`
        is called as each token is sampled (a streaming server's hook; call_prefix begins the ids of this reply's tool
        calls); a retry answered from the record never calls it. `options`: the tool choice and the chat template's
        switches (default: auto, none)."""
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
            raise ContextOverflow(len(prompt_ids), self.max_length,
                                  f"the prompt holds {len(prompt_ids)} tokens, at or over the session's context of "
                                  f"{self.max_length}, which leaves no room for a reply; shorten the conversation")
        call_prefix = f"call-{self.ledger.rollout_id}-{self.turns}"
        relay = None if on_token is None else (lambda _, token_id: on_token(prompt_ids, token_id, call_prefix))
        # a Router sends every turn of the session to the engine that holds its prefix
        sticky = {"session_ids": [self.ledger.rollout_id]} if isinstance(self.engine, Router) else {}
        engine_params = replace(self._tool_sampling(params, tools, options), max_tokens=min(params.max_tokens, room))
        gen = self.engine.generate([prompt_ids], engine_params, relay, images=[images] if images else None,
                                   **sticky)[0]
        text = opening + reply_text(self.tokenizer, gen, params.stop)
        message = {"role": "assistant", "content": text} if options.tool_choice == "none" else \
            parse_hermes_tool_calls(text, call_prefix)
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
        return wires.ChatTurn(message, gen, extended, stop_sequence, text, call_prefix)

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
        chars, widest = _text_chars(messages) + _text_chars(tools), data.longest_token_chars(self.tokenizer)
        limit = self.max_length * widest
        if chars > limit:
            raise ContextOverflow(-(-chars // widest), self.max_length,
                                  f"the request holds {chars} characters of text, more than a context of "
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
    into `samplings` (what was enforced: greedy, a bias or ban, penalties, a grammar; the first entry is context's).
    `prefill`: per committed turn, its prompt's tokens, how many the engine took from its prefix cache (the turns
    before computed them) and how many it computed."""
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
        prefill = [{"prompt_tokens": len(g.prompt_ids), "cached_prompt_tokens": g.cached_prompt_tokens,
                    "computed_prompt_tokens": len(g.prompt_ids) - g.cached_prompt_tokens} for g in session.generations]
    return {"rollout_id": session.ledger.rollout_id, "group_id": session.ledger.group_id, "segments": segments,
            "samplings": [wires.sampling_json(x) for x in samplings], "prefill": prefill}
