# session.py — one rollout's token-exact chat session: messages in, the sampled reply out, the ledger kept.
#
# Owns: `ChatSession`, one per rollout, which turns a chat request (a message list) into engine prompt
# ids, generates, and commits the turn to the token record of the line it belongs to (returning a `wires.ChatTurn`);
# `Budget`, what a rollout may sample in all (the budget rule, below);
# its lines (`Line`, `LineLedger`: below); the echo rule; the reply's structure, read by wires' Hermes/Qwen
# `<tool_call>` parser (a call's id is the turn's prefix and its block's ordinal, so a streaming wire can name a call
# before its block is whole); the image bounds read from headers; the session's trace (what the trainer will see, token
# by token, and what each turn's prefill computed and took from the engine's prefix cache: the cost of a long episode).
# loopback.py serves these sessions over HTTP.
#
# Keeps invariant 1 (token identity) for agents that only speak text. An agent echoes the assistant's
# reply back as *text*; rendering that text again and re-encoding it would not give back the sampled ids
# (BPE splits are many-to-one, tool JSON is re-serialized, templates strip <think>). So a new request
# that only appends messages to a line (the three checks of `_delta_text`) is served as: the line's exact tokens +
# the encoded *delta* text, which always extends its open segment. Anything else (edited history, a template that
# rewrote an earlier turn, compaction) is rendered and encoded whole. Whether a turn seals is then decided by
# the ledger alone, from ids and images, never from text: `TokenLedger.extend_or_seal` seals exactly when the
# open segment's token ids are not a prefix of the new prompt's ids, or its images are not the first images of
# the new prompt (the same objects; a session processes each image URL once, so an unchanged image is the same
# object). A whole re-encoding whose ids still begin with every recorded id extends; one that differs at any
# recorded position seals. An MoE turn sampled at a new policy version seals too, after its prompt extended (the
# ledger's route_version: its routes at the recorded positions are the new weights'), and `ChatTurn.extended` stays
# the prompt's answer.
# The echo rule. A harness echoes a tool call back in its own rendering: Claude Code echoes Edit's
# {"new_string", "old_string", "file_path"} as {"replace_all": false, "file_path", "old_string", "new_string"} (keys in
# its schema's order, the schema's declared default added). Such an echo is the sampled call in another rendering, and
# it extends the record: a request whose messages start with a line's last request and reply, each message equal to
# the recorded one except that a tool call's arguments may list their keys in another order and may add keys whose
# value equals the tool schema's declared `default` (at any depth the schema declares), is that line's continuation,
# and the recorded messages stand in for the echoed ones before anything is rendered. Any other difference (a value
# changed, a key dropped, a key added that the schema gives no default, or another value; true is not 1) is an edit:
# the request is rendered as sent, and the ledger seals if the ids differ. This keeps invariant 1: the prompt is still
# the ledger's exact ids plus the new messages' encoding, so the engine's context at the recorded positions is the
# ledger's sampled ids (what the trainer trains on, in the context they were sampled in), and the agent's rendering of
# the same call is never encoded at those positions. What the model reads back is its own call; what the agent meant
# by its echo is the same call (a JSON object's key order carries nothing, and a declared default is what the tool
# does without the key), so nothing the agent said is lost.
# Lines. A harness may send other conversations on the rollout's session: Claude Code's sub-agents (their own system
# prompt and tools: real work), its session-title request (another system prompt, no tools, a JSON format). Each is a
# line with a record of its own, so a side request neither seals the main conversation nor is sealed by it. A request
# goes, among the lines of its thread, to (1) the line it continues (its last request and reply, under the echo rule;
# the most recently served first), else (2) the line with the same opening (system prompt and first user message): an
# edit or a rebuilt history, which extends or seals by ids as before, else (3) the thread's first line (the main line
# for the first agent's) when its system prompt is that line's (a conversation compacted or restarted: it seals), else
# (4) a new line. A thread is the sub-agent a harness names on its request (TurnOptions.thread): Codex's sub-agents
# share the main conversation's system prompt, and one forked from it continues its history, so without their thread
# they would join the main line by (3) or (1), each request sealing the other agent's turns. The main line is the
# first line opened by a request that offered tools, or the first line when none did (Claude Code names its session
# before its first turn, with no tools); the others are side lines, labelled side-<k> (k: the order they opened in),
# on every segment (`Segment.line`), so the trace and the trainer see them labelled. Which train is the runner's
# setting (ChatAgentRunner.train_side_lines: ChatSession.record), read from the record: by default a side line trains
# when its last reply's text is in what the main line is given after it (a sub-agent's result: it feeds the episode),
# and not when it never reaches the main line (a title: it only describes it). Two conversations with the same opening
# are one line (they seal each other, as one conversation rewritten would).
# Compaction stays on its line. A harness's summary request opens as the conversation it summarizes (Claude Code and
# Codex send that conversation, their instruction last, under its system prompt; Codex drops its tools), so it goes to
# that line by (1) or (2), and its prompt, no extension of the record, seals the turns before it; the prompt the
# harness goes on with (the summary in a user message) goes to the same line by (2) or (3) and seals the summary's
# segment. So the summary is a segment of its own on the line whose outcome it shapes, trained with the rollout's
# reward (as CompactionRL trains summaries: masked, they degenerate); one under a system prompt of its own is (4).
# A turn is committed only after generation succeeds (a turn recorded before a failed generation would leave
# context with no reply, and the retry would append a second copy); the sampled text is never re-encoded.
# A retried request (identical messages, tools, sampling and turn options to a line's last one) is answered from the
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
# The budget rule: a rollout's session holds its Budget (of_run: max_turns model calls, max_turns x max_tokens sampled
# tokens, at most a context's worth), and every line's turns and tokens count against it (every line is the engine's
# work and may train). A request's max_tokens is clipped to the tokens left, the reply's usage naming the cut
# (wires.BudgetCut); a request once turns or tokens are spent is answered as a reply cut at its limit with no token,
# nothing rendered, generated or recorded: each wire's own "the output limit was reached", which agents and harnesses
# end an episode on (a 429 would be retried until the rollout's deadline, a 400 read as a failure of the agent's own).
# So the rollout's record never holds more than train.py's constant token budget (Dr.GRPO's) assumes.
# Text is text: a special-token string inside a message reaches the model as characters (data.encode_text).
# Images reach a VLM processed once per session, their pads expanded, and recorded with the row. Never: speaks
# HTTP, computes rewards or trains.
from __future__ import annotations

import base64
import copy
import io
import json
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PIL import Image

import data
import invariants
import wires
from engines import Generation, SamplingParams, find_stop
from engines import constraints
from router import Router


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
SIDE_LINE_RULES = ("feeding", "all", "none")      # which side lines a rollout trains (ChatSession.record)


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

def context_length(engine, max_length: int | None) -> int:
    """A context (prompt and reply) of `max_length` tokens: by default the most `engine` serves, its model's position
    limit, and never more (a prompt past it is refused, never served)."""
    context = max_length or engine.max_model_len
    if not 1 < context <= engine.max_model_len:
        raise ValueError(f"max_length {context} must be in [2, {engine.max_model_len}], the most the engine serves "
                         f"(its model's position limit)")
    return context


class ContextOverflow(ValueError):
    """A prompt that leaves no room for a reply in the session's context. The server answers it in each wire's own
    words (wires.ContextLengthExceeded), which a harness recognises and compacts its conversation on."""

    def __init__(self, prompt_tokens: int, context: int, message: str):
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context   # the prompt (or a lower bound on it), the context


class TurnCut(Exception):
    """A turn whose client hung up mid-reply: its sampling stopped at the next token and the turn is dropped whole,
    never recorded in part. A part would be a reply nobody read and cut where no stop token or max_tokens ends it;
    dropped, the record stays the replies the agent got, each token with its logprob and version (invariant 1),
    and a retry samples the turn afresh, as after a failed generation."""

    def __init__(self, rollout_id: str):
        super().__init__(f"session {rollout_id}: the client hung up mid-reply; sampling stopped and the turn was "
                         f"dropped (nothing recorded)")


# ---- a rollout's budget: what it may sample, over all its turns ----------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """What one rollout may sample (the budget rule, header): `turns` model calls and `tokens` sampled tokens in all,
    over every line of its session (or every turn of an Env episode)."""
    turns: int
    tokens: int

    @classmethod
    def of_run(cls, max_turns: int, max_tokens: int, max_length: int) -> Budget:
        """The run's (--rollout.max_turns, max_tokens, max_length): max_turns turns of max_tokens, and never more than
        one context's worth of sampled tokens, the bound train.py's constant token budget (Dr.GRPO's) divides by."""
        return cls(max_turns, min(max_turns * max_tokens, max_length - 1))

    def cut(self, turns: int, tokens: int, asked: int) -> wires.BudgetCut | None:
        """What the budget does to a request for `asked` tokens after `turns` turns that sampled `tokens`: None when it
        leaves the request as it is, else the max_tokens it allows (0: the budget is spent)."""
        turns_left, tokens_left = max(self.turns - turns, 0), max(self.tokens - tokens, 0)
        allowed = min(asked, tokens_left) if turns_left else 0
        if allowed == asked:
            return None
        spent = "is spent: nothing was sampled; end the episode" if allowed == 0 else \
            f"leaves {allowed} tokens for this reply"
        return wires.BudgetCut(allowed, turns_left, tokens_left,
                               f"this rollout's budget of {self.turns} turns and {self.tokens} sampled tokens {spent}")


# ---- the echo rule: a recorded message in the agent's rendering (header) ----------------------------------

def same_json(a, b) -> bool:
    """JSON equality: types matter (true is not 1, "1" is not 1), a number is its value (1 is 1.0), key order not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _same_arguments(echoed, sampled, schema) -> bool:
    """A call's arguments as echoed vs as sampled: the same keys and values in any order, plus keys the schema gives
    a `default` that they equal; nested objects by their own property schemas."""
    if not (isinstance(echoed, dict) and isinstance(sampled, dict)):
        return same_json(echoed, sampled)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    if sampled.keys() - echoed.keys():
        return False                                       # a key the agent dropped
    for key, value in echoed.items():
        declared = properties.get(key)
        if key in sampled:
            if not _same_arguments(value, sampled[key], declared):
                return False
        elif not (isinstance(declared, dict) and "default" in declared and same_json(value, declared["default"])):
            return False
    return True


def _same_call(echoed, sampled: dict, schemas: dict[str, dict]) -> bool:
    function = echoed.get("function") if isinstance(echoed, dict) else None
    if not (isinstance(function, dict) and echoed.keys() == sampled.keys()
            and function.keys() == {"name", "arguments"}):
        return False
    name = sampled["function"]["name"]
    return (same_json({k: v for k, v in echoed.items() if k != "function"},
                      {k: v for k, v in sampled.items() if k != "function"}) and function["name"] == name
            and _same_arguments(function["arguments"], sampled["function"]["arguments"], schemas.get(name)))


def is_echo(echoed: dict, recorded: dict, schemas: dict[str, dict]) -> bool:
    """Whether `echoed` is the `recorded` message in another rendering (the echo rule, header): equal, except that its
    tool calls' arguments may order keys differently and add keys at their schema's default. `schemas`: each offered
    tool's parameter schema by name."""
    calls = recorded.get("tool_calls") if isinstance(recorded, dict) else None
    if not calls or not isinstance(echoed, dict) or not isinstance(echoed.get("tool_calls"), list):
        return same_json(echoed, recorded)
    rest = [{k: v for k, v in m.items() if k != "tool_calls"} for m in (echoed, recorded)]
    return same_json(*rest) and len(echoed["tool_calls"]) == len(calls) and \
        all(_same_call(e, c, schemas) for e, c in zip(echoed["tool_calls"], calls))


# ---- lines: the conversations one session serves (header) ---------------------------------------------------

class LineLedger(invariants.TokenLedger):
    """A line's token record: a TokenLedger whose segments carry the line's label (Segment.line)."""

    def __init__(self, rollout_id: str, group_id: str, label: str):
        super().__init__(rollout_id, group_id)
        self.label = label

    def _new_segment(self) -> invariants.Segment:
        self.segments.append(invariants.Segment(self.rollout_id, self.group_id, len(self.segments), [], [], [], [], [],
                                                line=self.label))
        return self.segments[-1]

    def relabel(self, label: str) -> None:
        self.label = label
        for segment in self.segments:
            segment.line = label


def opening(messages: list[dict]) -> tuple:
    """A conversation's opening: its system prompt (None without one) and its first user message's content."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    return system, next((m["content"] for m in messages if m["role"] == "user"), None)


@dataclass
class Line:
    """One conversation on a session, with its own token record."""
    index: int                       # the order it opened in, within its session
    opening: tuple                   # its first request's opening(): how a rewritten history finds it again
    offers_tools: bool               # its first request offered tools (the main line is the first that did)
    ledger: LineLedger
    thread: str = ""                 # the harness's sub-agent it serves (TurnOptions.thread; "": the first agent)
    expected: list[dict] | None = None     # what the next request must start with to continue it: the last
                                           # request's messages (as recorded) plus the reply as returned
    expected_prompt_text: str = ""   # their rendering up to the generation prompt
    echo_text: str = ""              # how the last reply must open its echoed assistant block
    last_request: tuple | None = None      # (messages, tools, sampling, options) of its last committed turn
    last_turn: wires.ChatTurn | None = None
    generations: list[Generation] = field(default_factory=list)   # the engine's output of its turns, in order: the
                                           # run-time check that the ledger trains each sampled token once
    order: list[int] = field(default_factory=list)   # each of its turns' place among the session's turns (routing
                                                     # tries the most recently served line first)

    @property
    def turns(self) -> int:
        return len(self.generations)


class ChatSession:
    """One rollout's conversations with the engine (its lines), token-exact across turns. `max_length`: the context,
    prompt and reply (default: the most the engine serves, its model's position limit); `sampling`: the defaults a
    request overrides (default: a reply may take the rest of the context)."""

    def __init__(self, engine, tokenizer, rollout_id: str, group_id: str = "", template: str | None = None,
                 sampling: SamplingParams | None = None, max_length: int | None = None, image_processor=None,
                 given: list[dict] | None = None, budget: Budget | None = None):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.budget = budget                   # None: no bound beyond the context (a session opened over HTTP)
        self.budget_cuts = 0                   # turns the budget cut short or refused (the rollout is truncated)
        self.rollout_id, self.group_id = rollout_id, group_id
        # the engine's prefix-cache salts (engines/prefix_cache.py's rule): a secret of this session's own, never an
        # id a client names; and the group's, for a request whose prompt is exactly `given`'s (the task's messages as
        # the trainer gave them, rendered here as a first request without tools renders them; a task with images has
        # none: its pads expand per session)
        self.cache_salt = f"rollout:{secrets.token_hex(16)}"
        self.given_ids = data.encode_text(tokenizer, self._render(given, None, True, None)) \
            if given and group_id else None
        self.max_length = context_length(engine, max_length)
        self.sampling = sampling or SamplingParams(max_tokens=self.max_length)
        # the most text a prompt may hold (what the wires bound a request's references with, before expanding them)
        self.text_bound = wires.TextBound(self.max_length, data.longest_token_chars(tokenizer))
        self.image_processor = image_processor  # None: a text-only model, and image parts are refused
        # Each picture is processed once per session, so one that comes back in the history is the same
        # ImageInput object: that is how the ledger tells an unchanged image from a changed one.
        self._images: dict[str, invariants.ImageInput] = {}
        self.lines: list[Line] = []            # in the order they opened
        self.lock = threading.Lock()           # one turn at a time per session
        self.ledger_lock = threading.Lock()    # held only while a turn commits: the trace never waits on a generation
        self.last_used = time.monotonic()      # when a turn last started or ended (idle sessions may expire)
        self.cut_turns = 0                     # turns whose client hung up mid-reply (TurnCut): none recorded
        self.max_tokens_turns = 0              # replies, on any line, that hit max_tokens before a stop token
        self.image_pad_turns = 0               # replies in which a VLM sampled its image placeholder: no image fills
                                               # that pad, so the row cannot be trained on

    # -- the main line (header), and what a rollout trains --

    @property
    def main_line(self) -> Line | None:
        return next((line for line in self.lines if line.offers_tools), self.lines[0] if self.lines else None)

    @property
    def ledger(self) -> invariants.TokenLedger:
        """The main line's token record (an empty one before the first turn)."""
        return self.main_line.ledger if self.lines else LineLedger(self.rollout_id, self.group_id, invariants.MAIN_LINE)

    @property
    def generations(self) -> list[Generation]:
        """The main line's generations, in order (what its rows train, each sampled token once)."""
        return self.main_line.generations if self.lines else []

    @property
    def turns(self) -> int:
        """The main line's committed turns."""
        return self.main_line.turns if self.lines else 0

    @property
    def side_lines(self) -> list[Line]:
        main = self.main_line
        return [line for line in self.lines if line is not main]

    @property
    def sampled_tokens(self) -> int:
        """Every line's sampled tokens (what the budget counts)."""
        return sum(len(gen.token_ids) for line in self.lines for gen in line.generations)

    def feeds_main_line(self, line: Line) -> bool:
        """Whether a side line's last reply is in what the main line was given after it (decoded, whitespace aside: a
        harness may indent a sub-agent's report; as written or as a JSON string: Codex's): each later main-line prompt
        past what the main line already held (its previous prompt and reply), so the main line's own replies never
        count."""
        reply = self.tokenizer.decode(line.generations[-1].token_ids, skip_special_tokens=True)
        forms = {" ".join(text.split()) for text in (reply, json.dumps(reply, ensure_ascii=False)[1:-1])}
        main, held = self.main_line, []
        for served, gen in zip(main.order, main.generations):
            given = " ".join(self.tokenizer.decode(gen.prompt_ids[len(held):] if gen.prompt_ids[:len(held)] == held
                                                   else gen.prompt_ids).split())
            if reply.strip() and served > line.order[-1] and any(form in given for form in forms):
                return True
            held = gen.prompt_ids + gen.token_ids
        return False

    def record(self, side_lines: str) -> tuple[list[invariants.Segment], list[Generation]]:
        """What a rollout trains: the main line's rows, then those of the side lines `side_lines` picks ("feeding": each
        that feeds_main_line; "all"; "none") in the order they opened, and their generations so (check_sampled_once)."""
        trains = {"feeding": self.feeds_main_line, "all": lambda line: True, "none": lambda line: False}[side_lines]
        lines = [line for line in [self.main_line, *filter(trains, self.side_lines)] if line is not None]
        return ([row for line in lines for row in line.ledger.rows()],
                [gen for line in lines for gen in line.generations])

    def served_in_order(self) -> list[Generation]:
        """Every line's generations in the order the session served them (one per answered request)."""
        return [gen for _, gen in sorted((k, gen) for line in self.lines for k, gen in zip(line.order,
                                                                                           line.generations))]

    # -- turns --

    def turn(self, messages: list[dict], tools: list[dict] | None = None, sampling: SamplingParams | None = None,
             on_token: Callable[[list[int], int, str], None] | None = None,
             options: wires.TurnOptions | None = None, hung_up: threading.Event | None = None) -> wires.ChatTurn:
        """Generate the assistant's reply to `messages` and commit it to its line. `on_token(prompt_ids, token_id,
        call_prefix)` is called as each token is sampled (a streaming server's hook; call_prefix begins the ids of this
        reply's tool calls); a retry answered from the record never calls it. `options`: the tool choice and the chat
        template's switches (default: auto, none). Once `hung_up` is set (the client is gone) the engine stops at its
        next token and TurnCut is raised: the turn is dropped whole, as a failed generation is."""
        params, options = sampling or self.sampling, options or wires.TurnOptions()
        with self.lock:
            self.last_used = time.monotonic()
            for line in self.lines:
                if line.last_request == (messages, tools, params, options):   # a retry: answer from the record
                    return line.last_turn
            served = sum(line.turns for line in self.lines)
            budget = self.budget.cut(served, self.sampled_tokens, params.max_tokens) if self.budget else None
            if budget is not None and budget.max_tokens == 0:    # spent: answered as a reply cut with no token
                self.budget_cuts += 1
                return wires.ChatTurn({"role": "assistant", "content": ""}, Generation([], [], [], [], None, "length"),
                                      False, budget=budget)
            # copied before anything commits
            request = (copy.deepcopy(messages), copy.deepcopy(tools), params, copy.deepcopy(options))
            line, recorded = self._route(messages, tools, options)
            line, turn = self._generate_and_commit(line, recorded, tools, params, options, on_token, hung_up,
                                                   budget, served)
            line.last_request, line.last_turn = request, turn
            self.last_used = time.monotonic()
            return turn

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None,
                   options: wires.TurnOptions | None = None) -> list[int]:
        """The engine prompt a turn with these messages would get now (its line found, its record extended or not),
        nothing generated or recorded: what count_tokens answers."""
        options = options or wires.TurnOptions()
        with self.lock:
            line, recorded = self._route(messages, tools, options)
            self._bound_prompt(recorded, tools)
            opening = wires.CALL_OPENING if options.tool_choice in ("required", "named") else ""
            return self._prompt(line, recorded, tools, options.template_kwargs, opening)[0]   # a prompt a turn takes

    def _route(self, messages: list[dict], tools, options: wires.TurnOptions) -> tuple[Line | None, list[dict]]:
        """The line a request belongs to (None: it opens one) and its messages as recorded: a continuation's recorded
        messages stand in for their echo (the echo rule and the routing order: header)."""
        schemas = {tool["function"]["name"]: tool["function"].get("parameters")
                   for tool in [*(tools or []), *options.deferred_tools]}
        recent = sorted((line for line in self.lines if line.thread == options.thread),
                        key=lambda line: line.order[-1], reverse=True)
        for line in recent:
            expected = line.expected
            if expected is not None and len(messages) >= len(expected) and \
                    all(is_echo(m, e, schemas) for m, e in zip(messages, expected)):
                return line, expected + messages[len(expected):]
        start = opening(messages)
        same = next((line for line in recent if line.opening == start), None)
        if same is not None:
            return same, messages
        head = min(recent, key=lambda line: line.index, default=None) if options.thread else self.main_line
        if head is not None and head.thread == options.thread and start[0] == head.opening[0]:
            return head, messages
        return None, messages

    def _generate_and_commit(self, line: Line | None, messages: list[dict], tools, params: SamplingParams,
                             options: wires.TurnOptions, on_token, hung_up, budget: wires.BudgetCut | None,
                             served: int) -> tuple[Line, wires.ChatTurn]:
        """Generate, build the reply, then commit (a new line opens only now). Nothing that can fail runs after the
        ledger changes: a client answered with an error must find the session as it was, or its retry would sample
        the turn twice."""
        self._bound_prompt(messages, tools)
        opening_text = wires.CALL_OPENING if options.tool_choice in ("required", "named") else ""
        prompt_ids, images, prompt_text = self._prompt(line, messages, tools, options.template_kwargs, opening_text)
        room = self.max_length - len(prompt_ids)
        call_prefix = f"call-{self.rollout_id}-{served}"    # served: the session's turns before this one, so call
                                                            # ids stay unique across the session's lines

        def relay(_, token_id: int) -> None:      # on the engine's thread: raising there stops this row alone
            if hung_up is not None and hung_up.is_set():
                raise TurnCut(self.rollout_id)
            if on_token is not None:
                on_token(prompt_ids, token_id, call_prefix)
        # a Router sends every turn of the session to the engine that holds its prefix
        sticky = {"session_ids": [self.rollout_id]} if isinstance(self.engine, Router) else {}
        # the session's own sampling's top_logprobs are recorded with every token (a run's score centering), whatever
        # a request asks for: the engine reports the larger count, the client gets its own
        recorded_top = self.sampling.top_logprobs
        if budget is not None and budget.max_tokens >= min(params.max_tokens, room):
            budget = None                                        # the context binds first: the budget did nothing
        allowed = min(params.max_tokens, room) if budget is None else budget.max_tokens
        engine_params = replace(self._tool_sampling(params, tools, options), max_tokens=allowed,
                                top_logprobs=max(params.top_logprobs, recorded_top), cache_salt=self.cache_salt,
                                given_salt=f"group:{self.group_id}" if prompt_ids == self.given_ids else "")
        try:
            if hung_up is not None and hung_up.is_set():
                raise TurnCut(self.rollout_id)    # gone before its prefill: nothing is computed
            gen = self.engine.generate([prompt_ids], engine_params, relay if on_token or hung_up else None,
                                       images=[images] if images else None, **sticky)[0]
        except TurnCut:
            self.cut_turns += 1
            raise
        answered = gen if engine_params.top_logprobs == params.top_logprobs else \
            replace(gen, top_logprobs=[top[:params.top_logprobs] for top in gen.top_logprobs]
                    if params.top_logprobs else None)
        text = opening_text + reply_text(self.tokenizer, gen, params.stop)
        message = {"role": "assistant", "content": text} if options.tool_choice == "none" else \
            wires.parse_hermes_tool_calls(text, call_prefix)
        # An echo must open with the reply as sampled, stop token included ("...<|im_end|>"), after the opening the
        # session forced. A reply cut at the agent's stop string opens with the text the agent got: the record keeps
        # the ids that wrote the stop string (the model did write them) and the template's closing follows them as
        # context.
        stop_sequence = gen.stop_string if gen.stop_string in params.stop else None
        echo_text = text if stop_sequence else \
            opening_text + self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        sampled_pad = self.image_processor is not None and \
            self.tokenizer.convert_tokens_to_ids(data.IMAGE_PAD) in gen.token_ids
        # commit: only now does the session change (a failed generate leaves it as it was)
        with self.ledger_lock:
            if line is None:
                line = Line(len(self.lines), opening(messages), bool(tools or options.deferred_tools),
                            LineLedger(self.rollout_id, self.group_id, invariants.MAIN_LINE), options.thread)
                self.lines.append(line)
                for each in self.lines:        # the main line may be a later one (the first to offer tools)
                    each.ledger.relabel(invariants.MAIN_LINE if each is self.main_line else f"side-{each.index}")
            extended = line.ledger.extend_or_seal(gen.prompt_ids, images)   # the ledger's answer, not the text's
            line.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions, gen.sampling,
                                       routed=gen.routes is not None, top=gen.top_logprobs, top_k=recorded_top)
            if gen.routes is not None:
                line.ledger.absorb_routes(gen.routes)
            line.generations.append(gen)
        self.max_tokens_turns += gen.finish_reason == "length"
        self.budget_cuts += budget is not None and gen.finish_reason == "length"
        self.image_pad_turns += sampled_pad
        line.order.append(served)
        line.expected = [*messages, message]
        line.expected_prompt_text = prompt_text
        line.echo_text = echo_text
        return line, wires.ChatTurn(message, answered, extended, stop_sequence, text, call_prefix, budget)

    def _tool_sampling(self, params: SamplingParams, tools, options: wires.TurnOptions) -> SamplingParams:
        """The request's sampling with what its tool choice asks of the engine: 'none' bans a one-token '<tool_call>'
        (a -inf logit bias, recorded per token like any bias); 'auto' with tools lets a response format's grammar
        take tool calls instead (deferred tools too: they are callable); no parallel calls stop at the first
        '</tool_call>'."""
        offered = [*(tools or []), *options.deferred_tools]
        if options.tool_choice == "auto" and offered and params.constraint is not None:
            params = replace(params, constraint=constraints.with_tool_calls(params.constraint, offered,
                                                                            options.parallel_tool_calls))
        if options.tool_choice == "none":
            opening_ids = self.tokenizer.encode(wires.CALL_OPENING.strip(), add_special_tokens=False)
            if len(opening_ids) == 1:
                bias = {**dict(params.logit_bias), opening_ids[0]: -math.inf}
                params = replace(params, logit_bias=tuple(sorted(bias.items())))
        if not options.parallel_tool_calls and wires.CALL_CLOSING not in params.stop:
            params = replace(params, stop=(*params.stop, wires.CALL_CLOSING))
        return params

    def _bound_prompt(self, messages: list[dict], tools) -> None:
        """Refuse a request whose text cannot fit the context before rendering or encoding any of it: no token
        spans more characters than the longest vocabulary entry, so more characters than max_length times that
        can only be more than max_length tokens. (A 20 MB message would otherwise be encoded in full first.)"""
        chars, bound = wires.text_chars(messages) + wires.text_chars(tools), self.text_bound
        if chars > bound.chars:
            raise ContextOverflow(-(-chars // bound.token_chars), self.max_length,
                                  f"the request holds {chars} characters of text, more than a context of "
                                  f"{self.max_length} tokens can hold (at most {bound.chars}); shorten the "
                                  f"conversation")

    def _render(self, messages, tools, generation_prompt: bool, template_kwargs: dict | None) -> str:
        return data.render_prompt_text(self.tokenizer, messages, tools, self.template, generation_prompt,
                                       template_kwargs)

    def _prompt(self, line: Line | None, messages: list[dict], tools, template_kwargs: dict | None = None,
                opening_text: str = "") -> tuple[list[int], list[invariants.ImageInput], str]:
        """The engine prompt for this request on `line` (ids, and every image its pads stand for) and the request
        rendered up to the generation prompt. When the request only appends messages to the line, the prompt is the
        line's exact tokens plus the new messages encoded (and only their images are new); otherwise (or on a new
        line) it is encoded whole, and the ledger will seal. `opening_text` (a forced call's) is written after the
        generation prompt, as context."""
        images = self._prompt_images(messages)
        full = self._render(messages, tools, True, template_kwargs)
        delta = None if line is None else self._delta_text(line, messages, tools, full, template_kwargs)
        if delta is None:
            ids = self._encode(full + opening_text, images, 0)
        else:
            fresh = images[len(line.ledger.open_images):]
            ids = line.ledger.open_token_ids + self._encode(delta + opening_text, fresh, len(line.ledger.open_token_ids))
        if len(ids) >= self.max_length:
            raise ContextOverflow(len(ids), self.max_length,
                                  f"the prompt holds {len(ids)} tokens, at or over the session's context of "
                                  f"{self.max_length}, which leaves no room for a reply; shorten the conversation")
        return ids, images, full

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

    def _encode(self, text: str, images: list[invariants.ImageInput], after: int) -> list[int]:
        """Encode rendered text once, to follow `after` tokens of prompt (the messages' text as text,
        data.encode_text); for a VLM each image's single pad becomes its run of n_tokens pads. Text that cannot fit
        the rest of the context is refused having encoded at most about twice the context's tokens (data.encode_text's
        bound), so its cost is the context's, whatever its length."""
        try:
            ids = data.encode_text(self.tokenizer, text, self.max_length - after)
        except data.TooManyTokens as error:
            raise ContextOverflow(after + error.counted, self.max_length,
                                  f"the prompt counts about {after + error.counted} tokens (in pieces), over the "
                                  f"session's context of {self.max_length}, which leaves no room for a reply; shorten "
                                  f"the conversation") from None
        if self.image_processor is None:
            return ids
        return data.expand_image_pads(ids, images, self.tokenizer.convert_tokens_to_ids(data.IMAGE_PAD))

    def _delta_text(self, line: Line, messages, tools, full: str, template_kwargs: dict | None = None) -> str | None:
        """Text to append after the line's exact tokens, or None when this request is not an append to it.
        Three checks, each of which must hold: (1) the messages start with the line's last request plus our
        reply, as recorded (the echo rule put them there); (2) rendering that prefix is a string prefix of the new
        rendering (a template that strips earlier <think> fails here); (3) the prefix's assistant block starts with
        exactly the reply as sampled (re-serialized tool JSON fails here). What the template writes after the sampled
        text (the '\\n' after <|im_end|>, or a closing <|im_end|> when the reply hit max_tokens or a stop string)
        is context. The prefix is rendered with this request's tools and template switches: a change to either that
        rewrites the record's text fails (2)."""
        if line.expected is None or messages[:len(line.expected)] != line.expected:
            return None
        prefix = self._render(line.expected, tools, False, template_kwargs)
        if not full.startswith(prefix) or not prefix.startswith(line.expected_prompt_text):
            return None
        assistant_block = prefix[len(line.expected_prompt_text):]
        if not assistant_block.startswith(line.echo_text):
            return None
        return assistant_block[len(line.echo_text):] + full[len(prefix):]


def session_trace(session: ChatSession, tokenizer) -> dict:
    """The session's record as JSON: what the trainer will see, token by token, the main line's segments first and then
    each side line's, each labelled with its line. Each token's sampling is an index into `samplings` (what was
    enforced: greedy, a bias or ban, penalties, a grammar; the first entry is context's). `prefill`: per answered
    request in the order served, its prompt's tokens, how many the engine took from its prefix cache (the turns
    before computed them) and how many it computed."""
    samplings: dict[invariants.Sampling, int] = {invariants.UNSAMPLED: 0}
    with session.ledger_lock:
        lines = [line for line in [session.main_line, *session.side_lines] if line is not None]
        segments = [{"line": s.line, "segment_id": s.segment_id, "token_ids": s.token_ids,
                     "tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in s.token_ids],
                     "trainable": s.trainable, "behavior_logprobs": s.behavior_logprobs,
                     "sampling": [samplings.setdefault(x, len(samplings)) for x in s.sampling],
                     "policy_versions": s.policy_versions, "seal_reason": s.seal_reason,
                     "common_prefix_len": s.common_prefix_len,
                     "images": [{"grid_thw": image.grid_thw, "n_tokens": image.n_tokens} for image in s.images]}
                    for line in lines for s in line.ledger.segments]
        prefill = [{"prompt_tokens": len(g.prompt_ids), "cached_prompt_tokens": g.cached_prompt_tokens,
                    "computed_prompt_tokens": len(g.prompt_ids) - g.cached_prompt_tokens}
                   for g in session.served_in_order()]
    return {"rollout_id": session.rollout_id, "group_id": session.group_id, "segments": segments,
            "samplings": [wires.sampling_json(x) for x in samplings], "prefill": prefill}
