# engines/constraints.py — grammar constraints on sampling: OpenAI response_format (json_object, json_schema), a forced
# tool call (tool_choice required / a named function), and a response format with tools offered under tool_choice
# auto (its JSON or tool calls), as masks over the next token.
# Owns: the constraint spec (canonical JSON text, recorded in each token's invariants.Sampling.constraint), the
#   refusal of schemas that are invalid, unsupported, too large or too costly per token or in memory, and the one function of
#   (spec, tokenizer, ids) that gives the allowed ids before each token: `Matcher` while sampling, `replay_masks`
#   for the recompute (bound to a tokenizer by `mask_replayer`, what invariants.build_batch takes).
# Never: samples, touches logits or the ledger, or reads the network (a remote $ref is refused).
# Invariants: 3 (forward consistency) - the engine masks with `matcher` and the trainer with `replay_masks`, both
#   walking the same grammar over the same ids, so the recomputed distribution is the one each token was drawn from;
#   1 (token identity) - a row whose ids its recorded grammar does not allow is refused by position, never trained.
#
# Engine: llguidance (a maintained grammar engine; vLLM ships it as its "guidance" backend), chosen over xgrammar
# 0.2.8 (vLLM's default) by measuring both on SmolLM2's 49,152-id tokenizer (2 shared CPU cores):
#   - compile time: xgrammar precomputes per-state token masks, which an attacker can make slow with small schemas:
#     an object of 2,000 optional string properties (56 KB) took 53 s, the 60-character regex
#     ^([a-z]{1,64}\.){1,64}[a-z]{2,8}$ 7.2 s, one {"maxLength": 64} 0.6 s; llguidance builds each in 0.7 s,
#     1 ms and 1 ms, and bounds the work of every later mask step with deterministic fuel (LLParserLimits defaults),
#     so a replay hits any limit exactly where the engine did;
#   - coverage: xgrammar compiles but does not enforce "not", "if"/"then" or a two-branch "allOf" ({"not": {"type":
#     "string"}} lets "a" through: the engine would emit JSON its own schema rejects); llguidance refuses what it
#     cannot enforce ("Unimplemented keys: [...]");
#   - special tokens: llguidance never allows a special token as text (xgrammar let <|endoftext|> into a JSON
#     string); the only special ids a grammar here allows are its stop ids, after the JSON (and suffix) is complete.
#     (It counts every added token as special, so a JSON string spells "<think>" out; the tool-call suffix takes
#     the tokenizer's own "<tool_call>" / "</tool_call>" ids as well, see _literal_lark.)
#   Per-token mask time is sub-millisecond on average for both (llguidance's: `python bench/grammar_masks.py`).
# Per-token bound (the engine computes every row's mask on its decoding thread, so one session's grammar must not
#   slow the others' tokens): llguidance's fuel bounds a mask step's lexer and parser work (its LLParserLimits
#   defaults, which vLLM's guidance backend keeps: 200,000 lexer fuel, 50,000 Earley items), but not the text a
#   grammar forces ahead of a row, which it tokenizes again at every step: ^a{100000}$ cost 29 ms a token, where a
#   whole batch step took 2. MAX_FORCED_BYTES (1,024 bytes, at most 0.23 ms a token) caps that text: a schema that
#   forces more from its start is refused at compile time, saying so (a 400); a row that meets such a run later,
#   after a choice no compile-time walk can follow, stops at that step before its mask is computed, and the replay
#   refuses the same position.
# Memory bound (a grammar's lexer builds its automaton lazily, a state for each new place the text leads it, at
#   llguidance's estimate of 1-2 kB a state): a pattern whose automaton remembers where each letter stood, e.g.
#   ^[a-z]*[aeiou][a-z]{15}[a-z]*[st][a-z]{9}$, takes new states at every token the model writes and every token a
#   mask step tries from there. A template shared by every row of a spec kept them (up to llguidance's default of
#   250,000, where it stopped a row silently, its mask allowing only the stop id), 256 specs cached: 4 forced calls
#   of 120 such tools, each spec distinct, grew the loopback server by 1,269 MB (tests/test_loopback_attacks.py).
#   So each row builds its own matcher, freed with the row (vLLM's guidance backend builds one per request too),
#   capped at MAX_LEXER_STATES: the states a row creates follow from its grammar and its ids alone, so the engine's
#   row and the trainer's replay reach the cap at the same token, which stops the row (a 400 on the wires; the
#   replay refuses that position). vLLM keeps llguidance's default cap: a vLLM row past this one is refused by the
#   replay, never trained. A row's build costs 2-60 ms (the largest specs within the bounds, on SmolLM2).
# Text layout: one line, json.dumps's separators (", " and ": "), no free whitespace: the chat template renders
#   tool calls that way, and a small model cannot get stuck emitting whitespace forever.
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from numbers import Integral

import llguidance
import llguidance.hf
import numpy as np
import torch

# ---- bounds: checked before any grammar is built, so a cheap request never costs much ----
# The work of one parser step grows with the alternatives open at one position: an object's optional properties
# and a union's branches. llguidance refuses a step with more than 2,000 parser items in a row (its default, which
# vLLM's guidance backend keeps too, so both engines and the replay stop at the same places); measured on the
# first tokens of uniform walks, that limit was reached by 498 optional properties of one object, 282 branches of a
# union of open objects, 181 of objects with one optional property each (counted below: 282 * 2 = 564 and 181 * 3 =
# 543). MAX_SCHEMA_BREADTH keeps every schema at half of the least of these. Within the bounds a grammar builds in
# well under a second and a mask step takes milliseconds for a 49K vocabulary (python bench/grammar_masks.py).
MAX_SCHEMA_CHARS = 65_536    # compact JSON text of one schema
MAX_SCHEMA_DEPTH = 32        # nested JSON containers (an object property costs two: "properties" and its schema)
MAX_SCHEMA_NODES = 16_384    # JSON values in one schema (bounds the walk itself)
MAX_SCHEMA_BREADTH = 256     # optional properties + 2 per anyOf/oneOf/allOf branch, whole schema (or all the tools)
# Fuel bounds a step's lexer and parser work, but not the text a grammar forces ahead of a row (where one byte at a
# time is allowed): llguidance tokenizes all of it again at every mask step, to allow the one token it starts with,
# about 0.22 us a byte on SmolLM2's tokenizer. ^a{100000}$ (44 characters of schema) forces 100,002 bytes: 29 ms a
# token; ordinary grammars force a few dozen bytes (a property's name, "{", ", "), which cost nothing measurable.
MAX_FORCED_BYTES = 1024      # forced text ahead of a row at any step: at most 0.23 ms of tokenizing a token
# A row's lexer states (see the header's memory bound): 35 MB at the cap for 120 tools of growing patterns, after 632
# tokens; ordinary grammars walked 256 tokens on SmolLM2 in under 10,000 (a 4,000-character maxLength string the
# most), a hostile walk of an 8,000-character one in under 50,000.
MAX_LEXER_STATES = 50_000
LIMITS = llguidance.LLParserLimits(max_lexer_states=MAX_LEXER_STATES)   # llguidance's defaults otherwise
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # llguidance options
TOOL_CALL_OPENING = "<tool_call>\n"  # data.py's ChatML template opens every tool call with it
TOOL_CALL_SUFFIX = "\n</tool_call>"   # data.py's ChatML template closes every tool call with it
SPEC_FIELDS = ("kind", "schema", "suffix")  # + "stop" once bound
CALL_FIELDS = ("parallel", "tools")         # with_tool_calls: both, or neither


# ---- specs: what a request asks for, as canonical JSON text ----
# The spec is the whole constraint: the (strict-expanded) JSON schema, a literal suffix, and after bind() the stop
# ids, so another process (a Ray trainer) rebuilds the same grammar from the text alone. Outer keys are sorted and
# there is no whitespace, so equal constraints are equal strings. The schema travels as its own compact text, key
# order kept: the grammar emits an object's properties in the schema's order, so that order is part of the
# constraint and must not be sorted away.

def _spec(kind: str, schema: dict, suffix: str) -> str:
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return json.dumps({"kind": kind, "schema": text, "suffix": suffix}, sort_keys=True, separators=(",", ":"))


def json_object_spec() -> str:
    """response_format {"type": "json_object"}: any one JSON object."""
    return _spec("json_object", {"type": "object"}, "")


def json_schema_spec(schema: dict, strict: bool = True) -> str:
    """response_format {"type": "json_schema"}: one JSON value valid for `schema`. strict=True (OpenAI's strict
    mode) also closes every object schema that does not say otherwise (additionalProperties: false), so only
    declared properties are written; strict=False keeps JSON Schema's default (extra properties allowed).
    Raises ValueError for an invalid, unsupported or oversized schema, saying what is accepted."""
    _check_schema(schema, "the JSON schema")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be true or false, got {strict!r}")
    schema = _strict(schema) if strict else schema
    _check_grammar(schema, "the JSON schema")
    return _spec("json_schema", schema, "")


def tool_call_spec(tools: list[dict], name: str | None = None) -> str:
    """The text after a server-forced "<tool_call>\\n": one object {"name": <a tool's name, or `name`>,
    "arguments": <valid for that tool's parameters; a tool without parameters takes any object>}, "name" first,
    then TOOL_CALL_SUFFIX. `tools` are OpenAI function tools ({"type": "function", "function": {"name", "parameters",
    "strict"}}); a tool marked strict gets strict arguments (as json_schema_spec). Raises ValueError for a malformed
    tool, a bad parameters schema, a duplicate or unknown name."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of function tools, got {tools!r:.80}; a forced tool call "
                         f"needs a tool to call")
    branches, names, breadth = [], [], 0
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": <non-empty "
                             f"string>, \"parameters\": <JSON schema>}}}}, got {tool!r:.120}")
        tool_name = function["name"]
        if tool_name in names:
            raise ValueError(f"tools[{i}]: the name {tool_name!r} is used twice; tool names must be unique")
        names.append(tool_name)
        if name is not None and tool_name != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}   # none (or null): any object
        breadth += 2 + _check_schema(parameters, f"tools[{i}].function.parameters")   # each tool is a branch
        if breadth > MAX_SCHEMA_BREADTH:
            raise ValueError(f"the tools up to tools[{i}] come to a breadth of {breadth} (2 per tool, plus their "
                             f"optional parameters and union branches), more than {MAX_SCHEMA_BREADTH}; send fewer "
                             f"tools or name the one to call")
        if function.get("strict") is True:
            parameters = _strict(parameters)
        _check_grammar(parameters, f"tools[{i}].function.parameters")
        branches.append({"type": "object", "properties": {"name": {"const": tool_name}, "arguments": parameters},
                         "required": ["name", "arguments"], "additionalProperties": False})
    if name is not None and not branches:
        raise ValueError(f"tool_choice names the function {name!r:.80}, which is not among the tools "
                         f"{names!r:.400}; name one of them")
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"the tools' parameters come to {size} characters of JSON schema, more than "
                         f"{MAX_SCHEMA_CHARS}; send fewer or smaller tools, or name the one to call")
    _check_grammar(schema, "the tool call", TOOL_CALL_SUFFIX)   # a forced run may span name, arguments and suffix
    return _spec("tool_call", schema, TOOL_CALL_SUFFIX)


def with_tool_calls(spec: str, tools: list[dict], parallel: bool) -> str:
    """A response format's spec with tools offered under tool_choice auto (OpenAI: the format shapes the final
    message, and the model may call tools instead): the reply is the spec's JSON, or tool calls as the chat template
    writes them, TOOL_CALL_OPENING + one object of tool_call_spec(tools) + TOOL_CALL_SUFFIX, several joined by "\\n"
    when `parallel` (else exactly one). The opening is the model's to sample here, never forced. Raises ValueError
    for a spec that is not a response format's, and as tool_call_spec for the tools."""
    fields = _parse(spec)
    if fields["kind"] not in ("json_object", "json_schema") or set(fields) != set(SPEC_FIELDS):
        raise ValueError(f"with_tool_calls takes an unbound response format spec (json_object_spec or "
                         f"json_schema_spec), got {spec!r:.120}")
    if not isinstance(parallel, bool):
        raise ValueError(f"parallel must be true or false, got {parallel!r}")
    calls = _parse(tool_call_spec(tools))["schema"]   # the tools checked and bounded as a forced call's
    return json.dumps({**fields, "kind": fields["kind"] + "_or_tool_calls", "tools": calls, "parallel": parallel},
                      sort_keys=True, separators=(",", ":"))


def bind(spec: str, stop_token_ids: Sequence[int]) -> str:
    """The spec with the stop ids the engine ends on (sorted, unique): the grammar allows one of them, and only
    them, once the JSON (and suffix) is complete. The engine records the bound spec in Sampling.constraint."""
    fields = _parse(spec)
    if (not isinstance(stop_token_ids, Sequence) or isinstance(stop_token_ids, str) or not stop_token_ids
            or not all(isinstance(t, Integral) and not isinstance(t, bool) and t >= 0 for t in stop_token_ids)):
        raise ValueError(f"bind needs a non-empty sequence of non-negative int stop ids, got {stop_token_ids!r:.80}")
    fields["stop"] = sorted({int(t) for t in stop_token_ids})
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _parse(spec: str) -> dict:
    """The fields of a spec made here; ValueError for anything else (a constraint must be rebuilt exactly)."""
    try:
        fields = json.loads(spec)
    except (TypeError, ValueError):
        fields = None
    extra = set(fields) - {"stop"} - set(SPEC_FIELDS) if isinstance(fields, dict) else None
    if (extra not in (set(), set(CALL_FIELDS)) or not all(isinstance(fields.get(k), str) for k in SPEC_FIELDS)
            or (extra and not (isinstance(fields["tools"], str) and isinstance(fields["parallel"], bool)))):
        raise ValueError(f"{spec!r:.120} is not a constraint spec; build one with constraints.json_object_spec, "
                         f"json_schema_spec or tool_call_spec (with_tool_calls for a format with tools offered), "
                         f"and bind it to the stop ids")
    return fields


# ---- schema checks ----
# Order: a bounded walk (it stops at the first excess), the text size, then llguidance's own check, which refuses
# both an invalid schema ("Invalid type: strnig", "Expected array for 'required'") and what it cannot enforce; each
# refusal says what is accepted. (jsonschema's meta-schema check would add the path of an error but costs 0.56 s
# for a 1,000-property schema, more than everything else here together.)

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def _check_schema(schema: dict, where: str) -> int:
    """Refuse a schema that is not plain, bounded JSON; returns its breadth (for the tools' total)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object (a JSON Schema such as {{\"type\": \"object\", "
                         f"\"properties\": {{...}}}}), got {type(schema).__name__}")
    stack, nodes, breadth = [(schema, 1)], 0, 0
    while stack:   # iterative: a hostile nesting never reaches Python's recursion limit
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"{where} has more than {MAX_SCHEMA_NODES} JSON values; send a smaller schema")
        if isinstance(value, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"{where} is nested deeper than {MAX_SCHEMA_DEPTH} levels; flatten it (shared parts "
                                 f"can move to $defs and be reused with $ref)")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
        if isinstance(value, dict):   # counted wherever they appear (inside a "default" too): errs on the safe side
            required = value.get("required") if isinstance(value.get("required"), list) else []
            if isinstance(value.get("properties"), dict):
                breadth += sum(key not in required for key in value["properties"])
            breadth += sum(2 * len(value[k]) for k in ("anyOf", "oneOf", "allOf") if isinstance(value.get(k), list))
    if breadth > MAX_SCHEMA_BREADTH:
        raise ValueError(f"{where} has a breadth of {breadth} (optional properties, plus 2 per anyOf/oneOf/allOf "
                         f"branch), more than {MAX_SCHEMA_BREADTH}: the alternatives open at one step would make "
                         f"every token slow; mark properties required, or split the schema")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} is not plain JSON ({error}); use only objects, arrays, strings, finite numbers, "
                         f"booleans and null") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} is {len(text)} characters of JSON, more than {MAX_SCHEMA_CHARS}; send a smaller "
                         f"schema")
    if "x-guidance" in schema:
        raise ValueError(f"{where} sets \"x-guidance\", the grammar engine's own options; remove it (the layout "
                         f"is fixed: one line, \", \" and \": \" separators)")
    return breadth


def _strict(schema: dict) -> dict:
    """A copy of `schema` in which every object schema that does not say otherwise (additionalProperties,
    unevaluatedProperties or patternProperties) takes only its declared properties (OpenAI's strict mode)."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _strict(v) if isinstance(v, dict) else v for k, v in out[key].items()}
    for key in _SCHEMA_LISTS + _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
        elif isinstance(out.get(key), list):
            out[key] = [_strict(v) if isinstance(v, dict) else v for v in out[key]]
    kinds = out.get("type", [])
    is_object = "object" in (kinds if isinstance(kinds, list) else [kinds]) or "properties" in out
    if is_object and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _check_grammar(schema: dict, where: str, suffix: str = "") -> None:
    """llguidance's verdict on the schema, without a model's tokenizer (what it cannot enforce is refused, not
    ignored), then the text it forces from its start, the suffix after it included (a run met later is bounded by
    Matcher). A tokenizer's own tokens for the suffix (see _literal_lark) only ever shorten that text."""
    body = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    error = llguidance.LLMatcher.validate_grammar(body)
    if error:
        raise ValueError(f"{where} is not a JSON Schema the grammar engine can enforce: {error.strip():.300}. "
                         f"Enforced are type, properties, required, additionalProperties, patternProperties, items, "
                         f"prefixItems, minItems/maxItems, enum, const, anyOf, allOf, oneOf with disjoint branches, "
                         f"$ref/$defs, minimum/maximum (exclusive too), multipleOf, minLength/maxLength, pattern and "
                         f"format; refused, as not enforceable: not, if/then/else, uniqueItems, contains, "
                         f"dependentRequired/dependentSchemas")
    text = json.dumps(dict(schema, **{"x-guidance": JSON_LAYOUT}))   # the body as lark_grammar writes it
    walk = f"start: body {json.dumps(suffix) if suffix else ''}\nbody: %json {text}"
    _check_forced(llguidance.LLMatcher(_bytes_tokenizer(), walk, log_level=0, limits=LIMITS),
                  f"{where}, from its start,")


def _check_forced(ll: llguidance.LLMatcher, where: str) -> None:
    """Refuse a grammar state that forces more than MAX_FORCED_BYTES of text ahead, before a mask is computed
    from it (which would tokenize it all; this only finds it). The count follows from the grammar and the ids, so
    the engine and the replay stop at the same step. Finding the text is llguidance's own walk, bounded by its
    lexer fuel and the row's lexer states."""
    forced = len(ll.compute_ff_bytes().split(b"\xff")[0])   # the text: a forced stop id is a marker byte and its id
    if forced > MAX_FORCED_BYTES:
        raise ValueError(f"{where} forces {forced} bytes of text in a row, more than {MAX_FORCED_BYTES}: the grammar "
                         f"engine tokenizes all of it again before every token, which would slow every token of the "
                         f"batch; shorten the constant text, or the repetition (a pattern's {{n}}, minItems) that "
                         f"spells it out")


class _Bytes:
    """One token per byte, and an end token: lets llguidance walk a grammar's text before a model is known."""
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _bytes_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


# ---- grammars: a spec and a tokenizer -> an llguidance matcher (one per row, its lexer its own) ----

@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it, with the model's logits width (ids past the tokenizer are special,
    never allowed). Built once per tokenizer object (about 0.5 s for a 49K vocabulary)."""
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} ids; pass the "
                         f"model's logits width (config.vocab_size), which covers every id the tokenizer makes")
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def _literal_lark(text: str, tokenizer) -> str:
    """Literal text as a Lark sequence. llguidance treats every added token as special, so a non-special added token
    of this tokenizer that spells part of the text (Qwen's "<tool_call>", "</tool_call>") is allowed as itself or as
    text."""
    if not text:
        return ""
    added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
             if not t.special and t.content and t.content in text}
    if not added:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")", text)
    return " ".join(f"({json.dumps(p)} | <[{added[p]}]>)" if p in added else json.dumps(p) for p in pieces if p)


def lark_grammar(spec: str, tokenizer) -> str:
    """The bound spec as one llguidance Lark grammar for this tokenizer: the JSON body (its schema with JSON_LAYOUT),
    the suffix, then one of the stop ids; with tool calls admitted (with_tool_calls), the body or the calls. vLLM's
    guidance backend takes this same text, so the vLLM engine, the embedded engine and the replay all mask with one
    grammar."""
    fields = _parse(spec)
    if "stop" not in fields:
        raise ValueError("the constraint is not bound to stop ids; the engine calls constraints.bind(spec, "
                         "stop_token_ids) and records the bound spec")
    body = dict(json.loads(fields["schema"]), **{"x-guidance": JSON_LAYOUT})
    stop = " | ".join(f"<[{t}]>" for t in fields["stop"])
    grammar = f"body: %json {json.dumps(body)}"
    if "tools" not in fields:
        return f"start: body {_literal_lark(fields['suffix'], tokenizer)} ({stop})\n{grammar}"
    tool = dict(json.loads(fields["tools"]), **{"x-guidance": JSON_LAYOUT})
    calls = 'call ("\\n" call)*' if fields["parallel"] else "call"
    return (f"start: (body | calls) ({stop})\n{grammar}\ncalls: {calls}\n"
            f"call: {_literal_lark(TOOL_CALL_OPENING, tokenizer)} tool {_literal_lark(TOOL_CALL_SUFFIX, tokenizer)}\n"
            f"tool: %json {json.dumps(tool)}")


def _first_line(ll: llguidance.LLMatcher) -> str:
    """llguidance's error without the parser state it appends, saying which bound a lexer-state error is."""
    line = (ll.get_error().splitlines() or ["no message"])[0][:300]
    if "too many states" in line:
        line += (f" (the grammar's patterns took more than MAX_LEXER_STATES = {MAX_LEXER_STATES} lexer states, "
                 f"the memory bound of one row; simplify the patterns, e.g. fewer alternatives or repetitions after "
                 f"an unbounded one)")
    return line


# ---- matching: the allowed ids before each token ----

def _unpack(packed: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[rows, 4 * ceil(V / 32)] uint8 little-endian bitmask -> [rows, V] bool."""
    return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size].astype(bool))


class Matcher:
    """One row's place in its grammar. allowed(): the ids the grammar allows next, [vocab_size] bool (the engine
    sets the others to -inf before anything else); accept(id): the sampled id, ValueError if it was not allowed."""

    def __init__(self, ll: llguidance.LLMatcher, vocab_size: int):
        self._ll, self.vocab_size, self.n_accepted = ll, vocab_size, 0

    def _packed(self) -> np.ndarray:
        self._check()
        _check_forced(self._ll, f"the grammar after {self.n_accepted} tokens")   # a run past a choice: no compile
        packed = np.frombuffer(self._ll.compute_bitmask(), dtype=np.uint8)        # time walk sees every branch
        self._check()   # the mask step reached a bound: llguidance stops there, its mask allowing only the stop
        return packed

    def _check(self) -> None:
        if self._ll.get_error():
            raise ValueError(f"the grammar stopped after {self.n_accepted} tokens: {_first_line(self._ll)}")

    def allowed(self) -> torch.Tensor:
        return _unpack(self._packed()[None], self.vocab_size)[0]

    def accept(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            reason = f"outside the {self.vocab_size} logits"
        elif self._ll.is_stopped():
            reason = "the grammar had already ended at its stop id"
        elif not self._ll.is_error() and self._ll.consume_token(int(token_id)):
            reason = None
        else:   # llguidance's own first line: a token the grammar refuses, or a parser limit reached
            reason = _first_line(self._ll)
        if reason is not None:
            raise ValueError(f"token id {token_id} at generated position {self.n_accepted} is not allowed by the "
                             f"grammar constraint ({reason}); a constrained row samples only from Matcher.allowed()")
        self.n_accepted += 1


def matcher(spec: str, tokenizer, vocab_size: int) -> Matcher:
    """A fresh Matcher for one row (spec bound with bind()), with a lexer of its own: its memory is freed with the
    row and bounded by MAX_LEXER_STATES, reached at the same token by the engine and the replay."""
    grammar, stop = lark_grammar(spec, tokenizer), _parse(spec)["stop"]
    if max(stop) >= vocab_size:
        raise ValueError(f"stop ids {stop} are outside the vocabulary of {vocab_size} ids")
    ll = llguidance.LLMatcher(_ll_tokenizer(tokenizer, vocab_size), grammar, log_level=0, limits=LIMITS)
    if ll.get_error():
        raise ValueError(f"the constraint does not build a grammar: {_first_line(ll)}")
    _check_forced(ll, "the constraint, from its start,")   # a spec built elsewhere, without the check
    return Matcher(ll, vocab_size)


def replay_masks(spec: str, tokenizer, token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(token_ids), vocab_size] bool: row i is the allowed set before token_ids[i], the mask the engine sampled
    it under (what the trainer's recompute applies). ValueError naming the position of the first id the grammar
    does not allow: such a row was not sampled under its recorded constraint and must not train."""
    m = matcher(spec, tokenizer, vocab_size)
    packed = []
    for token_id in token_ids:
        packed.append(m._packed())
        m.accept(int(token_id))
    width = 4 * -(-vocab_size // 32)
    return _unpack(np.stack(packed) if packed else np.zeros((0, width), np.uint8), vocab_size)


def mask_replayer(tokenizer, vocab_size: int) -> Callable[[str, Sequence[int]], torch.Tensor]:
    """replay_masks bound to a tokenizer and the model's logits width: the grammar_masks invariants.build_batch
    replays each constrained run's masks with."""
    return lambda spec, token_ids: replay_masks(spec, tokenizer, token_ids, vocab_size)
