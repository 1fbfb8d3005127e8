# loopback.py — token-exact chat sessions: the core that the OpenAI / Anthropic wire server wraps.
#
# Owns: `ChatSession`, one per rollout, which turns a chat request (a message list) into engine prompt
# ids, generates, and commits the turn to the rollout's TokenLedger; `ChatTurn`, what a turn returns;
# the Hermes/Qwen `<tool_call>` parser that gives the reply its structure.
#
# Keeps invariant 1 (token identity) for agents that only speak text. An agent echoes the assistant's
# reply back as *text*; rendering that text again and re-encoding it would not give back the sampled ids
# (BPE splits are many-to-one, tool JSON is re-serialized, templates strip <think>). So a new request
# that only appends messages is served as: the ledger's exact tokens + the encoded *delta* text. Anything
# else (edited history, a template that rewrote an earlier turn, compaction) is re-rendered from scratch
# and the ledger seals the segment (the new prompt is not a bitwise extension of the old tokens).
# A turn is committed only after generation succeeds (Molt bug 41); the sampled text is never re-encoded.
# Never: speaks HTTP (the wire layer does) or computes rewards.
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, replace

import data
import invariants
from rollout import Generation, SamplingParams


@dataclass
class ChatTurn:
    message: dict                  # the assistant message returned to the agent (structured tool calls parsed)
    generation: Generation         # ids, behavior logprobs, versions and routes, exactly as sampled
    extended: bool                 # False when this request did not extend the record (a seal, or the first turn)


# ---- tool calls: read structure out of the sampled text, never write it back ------------------------

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str, call_prefix: str) -> dict:
    """Hermes/Qwen style: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` becomes an
    OpenAI-shaped tool call. A block that is not valid JSON with a string name stays in the content as
    text: the model's error is shown to the agent, never repaired. The token record is not touched."""
    calls, kept = [], []
    last = 0
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            valid = isinstance(call, dict) and isinstance(call.get("name"), str)
        except json.JSONDecodeError:
            valid = False
        if not valid:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append({"id": f"{call_prefix}-{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
    if not calls:       # the reply is returned byte for byte, so an echo of it extends the record
        return {"role": "assistant", "content": text}
    kept.append(text[last:])
    content = "".join(kept).strip()
    return {"role": "assistant", "content": content or None, "tool_calls": calls}


class ChatSession:
    """One rollout's conversation with the engine, token-exact across turns."""

    def __init__(self, engine, tokenizer, rollout_id: str, group_id: str = "", template: str | None = None,
                 sampling: SamplingParams | None = None, max_length: int = 4096):
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.sampling = sampling or SamplingParams()
        self.max_length = max_length
        self.ledger = invariants.TokenLedger(rollout_id, group_id)
        self.lock = threading.Lock()           # one turn at a time per session
        # What the next request must start with to count as an extension: the last request's messages
        # plus the reply as we returned it, and their rendering up to the generation prompt.
        self._expected: list[dict] | None = None
        self._expected_prompt_text = ""
        self._sampled_text = ""                # the last reply decoded with its special tokens (e.g. "...<|im_end|>")
        self._turns = 0

    def turn(self, messages: list[dict], tools: list[dict] | None = None,
             sampling: SamplingParams | None = None) -> ChatTurn:
        with self.lock:
            prompt_ids, extends = self._prompt_ids(messages, tools)
            room = self.max_length - len(prompt_ids)
            if room < 1:
                raise ValueError(f"the prompt holds {len(prompt_ids)} tokens, at or over the session's context "
                                 f"of {self.max_length}; shorten the conversation")
            params = sampling or self.sampling
            params = replace(params, max_tokens=min(params.max_tokens, room))
            gen = self.engine.generate([prompt_ids], params)[0]
            # commit: only now does the ledger change (a failed generate leaves the session as it was)
            self.ledger.extend_or_seal(gen.prompt_ids)
            self.ledger.append_sampled(gen.token_ids, gen.behavior_logprobs, gen.policy_versions)
            if gen.routes is not None:
                self.ledger.absorb_routes(gen.routes)
            text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            message = parse_hermes_tool_calls(text, f"call-{self.ledger.rollout_id}-{self._turns}")
            self._turns += 1
            self._expected = [*messages, message]
            self._expected_prompt_text = self._render(messages, tools, generation_prompt=True)
            self._sampled_text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
            return ChatTurn(message, gen, extends)

    def _render(self, messages, tools, generation_prompt: bool) -> str:
        return data.render_prompt_text(self.tokenizer, messages, tools, self.template, generation_prompt)

    def _prompt_ids(self, messages: list[dict], tools) -> tuple[list[int], bool]:
        """The engine prompt for this request, and whether it extends the record."""
        full = self._render(messages, tools, generation_prompt=True)
        delta = self._delta_text(messages, tools, full)
        if delta is None:
            return self.tokenizer.encode(full, add_special_tokens=False), False
        return self.ledger.open_token_ids + self.tokenizer.encode(delta, add_special_tokens=False), True

    def _delta_text(self, messages, tools, full: str) -> str | None:
        """Text to append after the record's exact tokens, or None when this request is not an append.
        Three checks, each of which must hold: (1) the messages start with the last request plus our
        reply, unedited; (2) rendering that prefix is a string prefix of the new rendering (a template
        that strips earlier <think> fails here); (3) the prefix's assistant block starts with exactly the
        sampled text (re-serialized tool JSON fails here). What the template writes after the sampled text
        (the '\\n' after <|im_end|>, or a closing <|im_end|> when the reply hit max_tokens) is context."""
        if self._expected is None or messages[:len(self._expected)] != self._expected:
            return None
        prefix = self._render(self._expected, tools, generation_prompt=False)
        if not full.startswith(prefix) or not prefix.startswith(self._expected_prompt_text):
            return None
        assistant_block = prefix[len(self._expected_prompt_text):]
        if not assistant_block.startswith(self._sampled_text):
            return None
        return assistant_block[len(self._sampled_text):] + full[len(prefix):]
