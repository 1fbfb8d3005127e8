# engines/harvest.py — what a program really sends, recorded to teach a tiny model to answer it.
#
# Owns: `ScriptEngine`, an engine that samples nothing and answers each generate call with the next reply of a
# script, and `teaching_texts`, the conversations a harvest recorded as the texts a tiny model is taught
# (models.taught_tiny_model_dir). A harvest runs a program unchanged (an agent library, a coding harness) against a
# real LoopbackServer over a ScriptEngine: the server renders every request exactly as it will for the policy, and the
# script stands in for a model that can already write the program's tool calls. bench/compat_matrix.py harvests six
# agent libraries this way; agents/harness.py, the coding harnesses (Codex, Claude Code).
# Never: samples, or trains on what it records (its generations carry no sampling and reach no trainer).
from __future__ import annotations

import invariants
from engines import Generation, per_prompt


class ScriptEngine:
    """Answers each generate call with the next reply of `replies` (text, encoded with `tokenizer`, closed by the
    chat template's end token), calling `on_token` for each id as a streaming server expects; with the script spent
    it answers an empty reply. One conversation at a time: set `replies` before each."""

    def __init__(self, tokenizer, max_model_len: int = 1 << 16):
        self.tokenizer, self.replies = tokenizer, []
        self.max_model_len = max_model_len          # the context a session over it may ask for
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params, on_token=None, images=None, **_) -> list[Generation]:
        reply = self.replies.pop(0) if self.replies else ""
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.end_id]
        max_tokens = per_prompt(1, params)[0][0].max_tokens     # a reply longer than that is cut, as sampled
        finish = "length" if len(ids) > max_tokens else "stop"
        ids = ids[:max_tokens]
        for token_id in ids:
            if on_token is not None:
                on_token(0, token_id)
        return [Generation(list(prompts[0]), ids, [0.0] * len(ids), [0] * len(ids), None, finish,
                           sampling=invariants.UNSAMPLED)]


def teaching_texts(tokenizer, generations: list[Generation]) -> list[str]:
    """Each turn of a harvest as the text a model must learn: the prompt the server built followed by the scripted
    reply. A turn whose whole text a later turn's extends is taught by that one (a program that re-renders its history
    seals, and then each of its turns stays)."""
    texts = list(dict.fromkeys(tokenizer.decode(g.prompt_ids + g.token_ids, skip_special_tokens=False)
                               for g in generations))
    return [text for text in texts if not any(other != text and other.startswith(text) for other in texts)]
