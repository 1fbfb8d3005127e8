# The wire formats on their own, without a server: the chat and Anthropic wires decode one conversation to the same
# canonical request (so token accounting cannot depend on the wire), refusals carry each wire's error shape,
# live streaming never sends text that the finished reply takes back (a stop string, a tool call, the
# whitespace a tool call drops) over thousands of random replies, and greedy is recorded as the point mass.
# The Anthropic wire's own (thinking blocks, documents, its stream's blocks): test_wire_anthropic.py.
import random
import time

import pytest
import torch

import models
from engines import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, find_stop
from engines.processing import processed_logprobs
from wires import LiveText, WireError, decode_openai
from wires import parse_hermes_tool_calls
from wires.anthropic import decode_anthropic

BASE = SamplingParams(max_tokens=16)


def test_one_conversation_decodes_to_the_same_canonical_request_on_both_wires():
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}}
    openai_body = {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
                     {"role": "user", "content": "Thanks."}],
        "tools": [{"type": "function", "function": {"name": "bash", "description": "Run.", "parameters": schema}}],
        "max_tokens": 8, "temperature": 0.5, "stop": "END"}
    anthropic_body = {
        "system": "Be brief.", "max_tokens": 8, "temperature": 0.5, "stop_sequences": ["END"],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}]},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "bash",
                                                        "input": {"cmd": "ls"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"},
                                                  {"type": "text", "text": "Thanks."}]}],
        "tools": [{"name": "bash", "description": "Run.", "input_schema": schema}]}
    openai, anthropic = decode_openai(openai_body, BASE), decode_anthropic(anthropic_body, BASE)
    assert openai.messages == anthropic.messages and openai.tools == anthropic.tools
    assert openai.sampling == anthropic.sampling == SamplingParams(temperature=0.5, max_tokens=8, stop=("END",))
    assert openai.messages[2]["tool_calls"][0]["function"]["arguments"] == {"cmd": "ls"}   # decoded, as the parser


def test_refusals_carry_each_wires_error_shape():
    with pytest.raises(WireError) as refused:
        decode_openai({"messages": [{"role": "user", "content": "hi"}], "n": 3}, BASE)
    assert refused.value.status == 400 and "n must be 1" in refused.value.body("openai")["error"]["message"]
    with pytest.raises(WireError) as refused:
        decode_anthropic({"messages": [{"role": "user", "content": "hi"}]}, BASE)
    assert refused.value.body("anthropic") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                          "message": "'max_tokens' is required"}}


FRAGMENTS = ["Hi", " there", " ", "\n", "  \n", "<", "<tool", "_call>", "<tool_call>", "</tool_call>",
             '{"name": "f", "arguments": {"a": 1}}', '{"name": 3}', "ST", "O", "P", "STOP", "é", "x"]


class EagerText(LiveText):
    """The negative control: sends every decoded character at once, holding nothing back."""

    def push(self, token_id: int) -> str:
        self.decoded.push(token_id)
        piece, self.sent = self.decoded.text[len(self.sent):], self.decoded.text
        return piece


def first_take_back(streamer: type[LiveText], tok, replies: int = 2000) -> tuple | None:
    """Stream random replies; the first (text, stops, sent, final content) where the stream sent text the
    finished reply does not begin with, or None. Also checks that sent + rest is always the content."""
    rng = random.Random(0)
    for _ in range(replies):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        stops = rng.choice([(), ("STOP",), ("ST", "\n\n")])
        # what the engine and session do: stop at the token that completes a stop string, then cut before it
        live, kept = streamer(tok, stops), []
        for token_id in tok.encode(text, add_special_tokens=False):
            kept.append(token_id)
            if stops and find_stop(tok.decode(kept), stops):
                break
        reply = tok.decode(kept)
        hit = find_stop(reply, stops) if stops else None
        content = parse_hermes_tool_calls(reply[:hit[0]] if hit else reply, "c")["content"] or ""
        sent = ""
        for token_id in kept:
            sent += live.push(token_id)
            if not content.startswith(sent):
                return text, stops, sent, content
        assert sent + live.rest(content) == content
    return None


def test_live_text_never_sends_what_the_finished_reply_takes_back():
    tok = models.bpe_tokenizer()
    assert first_take_back(EagerText, tok) is not None       # armed: a stream that holds nothing back is caught
    assert first_take_back(LiveText, tok) is None


@pytest.mark.parametrize("body, message", [
    ({"temperature": 1e-300}, "temperature"), ({"temperature": 2**63}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": 1e-46}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"stop": ["x" * 200_000]}, "stop"),
    ({"stop": ["a"] * 17}, "stop")])
def test_sampling_the_fp32_sampler_cannot_honour_is_refused(body, message):
    with pytest.raises(WireError, match=message) as refused:
        decode_openai({"messages": [{"role": "user", "content": "hi"}], **body}, BASE)
    assert refused.value.status == 400


def test_the_sampling_bounds_are_honoured_by_the_sampler():
    """At each bound the processed distribution is finite and sums to one (armed: just past them it is not)."""
    logits = torch.randn(2, 300) * 40
    for temperature, top_p in [(MIN_TEMPERATURE, 1.0), (MAX_TEMPERATURE, 1.0), (1.0, MIN_TOP_P), (MIN_TEMPERATURE,
                                                                                                   MIN_TOP_P)]:
        params = decode_openai({"messages": [{"role": "user", "content": "x"}], "temperature": temperature,
                                "top_p": top_p}, BASE).sampling
        probs = processed_logprobs(logits, params.temperature, params.top_p).exp()
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert not torch.isfinite(processed_logprobs(logits, 1e-300).exp()).all()
    assert not torch.isfinite(processed_logprobs(logits, 1.0, 1e-46).exp()).all()


def test_live_text_checks_a_long_stop_string_in_constant_time_per_token():
    tok = models.bpe_tokenizer()
    live = LiveText(tok, ("ab" * 500,))
    ids = tok.encode("ab" * 300 + "a", add_special_tokens=False)
    start = time.perf_counter()
    for token in ids * 3:
        live.push(token)
    assert time.perf_counter() - start < 2.0


def test_temperature_zero_is_greedy_on_both_wires_recorded_as_the_point_mass():
    ask = [{"role": "user", "content": "hi"}]
    openai_greedy = decode_openai({"messages": ask, "temperature": 0, "top_p": 0.5}, BASE).sampling
    anthropic_greedy = decode_anthropic({"messages": ask, "max_tokens": 16, "temperature": 0}, BASE).sampling
    assert openai_greedy == anthropic_greedy == SamplingParams(top_k=1, max_tokens=16)
    assert decode_openai({"messages": ask, "temperature": 0.5}, BASE).sampling.top_k == -1     # armed


def test_logit_bias_decodes_to_id_bias_pairs_sorted_by_id():
    ask = [{"role": "user", "content": "hi"}]
    biased = decode_openai({"messages": ask, "logit_bias": {"12": -100, "3": 5}}, BASE).sampling
    assert biased.logit_bias == ((3, 5.0), (12, -100.0))
