# The Anthropic messages wire on its own (wires/anthropic.py), without a server: documents and system turns decode
# to the canonical request, a thought becomes a thinking block, streamed or not, whose echo decodes to the text as
# sampled (an edited one as edited), and a stream builds exactly the blocks of the whole reply over thousands of random
# replies (armed: a stream that sends a thought eagerly is caught taking text back).
import json
import random

import models
from engines import Generation, SamplingParams
from wires import ChatTurn, LiveText, WireRequest
from wires import parse_hermes_tool_calls
from wires.anthropic import AnthropicStream, anthropic_reply, decode_anthropic

BASE = SamplingParams(max_tokens=16)


def test_documents_and_system_turns_decode_to_the_canonical_request():
    document = {"type": "document", "title": "a.txt", "context": "from the repo",
                "source": {"type": "content", "content": [{"type": "text", "text": "hello"}]}}
    read = {"role": "user", "content": [document, {"type": "text", "text": "Read it."}]}
    body = {"max_tokens": 4, "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, read]}
    assert decode_anthropic(body, BASE).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a.txt\n\nfrom the repo\n\nhello\n\nRead it."}]


def test_an_echoed_thinking_block_decodes_to_the_text_as_sampled():
    content = "<think>two\nsteps</think>\n \nDone."
    gen = Generation([1], [2], [0.0], [0], None, "stop")
    turn = ChatTurn({"role": "assistant", "content": content}, gen, False)
    for omit in (False, True):
        request = WireRequest([], None, BASE, False, omit_thinking=omit)
        blocks = anthropic_reply(turn, request, "m", "r")["content"]
        assert [b["type"] for b in blocks] == ["thinking", "text"] and blocks[1]["text"] == "Done."
        assert blocks[0]["thinking"] == ("" if omit else "two\nsteps")
        echo = {"max_tokens": 4, "messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": blocks},
                                              {"role": "user", "content": "again"}]}
        assert decode_anthropic(echo, BASE).messages[1] == {"role": "assistant", "content": content}
    edited = [{**blocks[0], "thinking": "one step"}, blocks[1]]
    echo["messages"][1]["content"] = edited        # armed: an edited thought is rendered as edited
    assert decode_anthropic(echo, BASE).messages[1]["content"] == "<think>one step</think>Done."


THINK_FRAGMENTS = ["<think>", "</think>", "<", "<th", "ink>", "</th", "</", "\n", " ", "  \n", "plan", "ok", "x",
                   "<tool_call>", '{"name": "f", "arguments": {"a": 1}}', "</tool_call>"]


class EagerThoughts(AnthropicStream):
    """The negative control: sends a thought as it arrives, not holding back what may begin '</think>'."""

    def _sendable(self):
        blocks = super()._sendable()
        if len(blocks) == 1 and blocks[0][0] == "thinking":
            return [("thinking", self.content[len("<think>"):], None)]
        return blocks


def streamed_blocks(stream_class, tok, text: str, omit: bool) -> tuple[list[dict], list[dict]]:
    """(the blocks an SDK assembles from the stream's events, the non-streamed reply's blocks) for one reply."""
    request = WireRequest([], None, BASE, True, omit_thinking=omit)
    stream, live, events = stream_class(request, tok, "m", "r"), LiveText(tok, ()), []
    ids = tok.encode(text, add_special_tokens=False)
    for token_id in ids:
        if piece := live.push(token_id):
            events += stream.text(piece)
    turn = ChatTurn(parse_hermes_tool_calls(tok.decode(ids), "c"), Generation([1], ids, [0.0] * len(ids),
                                                                              [0] * len(ids), None, "stop"), False)
    events += stream.finish(turn, live.rest(turn.message["content"]))
    blocks, open_blocks = {}, set()
    for name, event in events:
        index = event.get("index")
        if name == "content_block_start":
            assert index not in blocks
            blocks[index], open_blocks = dict(event["content_block"]), open_blocks | {index}
        elif name == "content_block_delta":
            assert index in open_blocks                     # never into a block not started or already stopped
            delta, block = event["delta"], blocks[index]
            key = {"text_delta": "text", "thinking_delta": "thinking",
                   "signature_delta": "signature"}.get(delta["type"])
            if key:
                block[key] += delta[key]
            else:
                block["input"] = json.loads(delta["partial_json"])
        elif name == "content_block_stop":
            open_blocks.remove(index)
    assert not open_blocks
    return [blocks[i] for i in sorted(blocks)], anthropic_reply(turn, request, "m", "r")["content"]


def first_mismatch(stream_class, tok, replies: int = 1500):
    rng = random.Random(1)
    for k in range(replies):
        text = "".join(rng.choice(THINK_FRAGMENTS) for _ in range(rng.randint(1, 10)))
        streamed, whole = streamed_blocks(stream_class, tok, text, omit=k % 4 == 0)
        if streamed != whole:
            return text, streamed, whole
    return None


def test_anthropic_streams_build_the_blocks_of_the_whole_reply_thoughts_included():
    tok = models.bpe_tokenizer()
    assert first_mismatch(EagerThoughts, tok) is not None       # armed: a thought sent eagerly is taken back
    assert first_mismatch(AnthropicStream, tok) is None
