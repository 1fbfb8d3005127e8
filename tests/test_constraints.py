# Tests for engines/constraints.py: grammar-constrained random walks over real tokenizers (the tiny BPE one and SmolLM2's)
# always end in JSON valid for the schema, the trainer's replay gives the walk's masks exactly, a row that leaves its
# grammar is refused by position, forced tool calls parse as calls of a listed tool, a response format with tools
# offered yields its JSON or tool calls (one, or several when parallel), specs are canonical, hostile schemas
# are refused quickly with messages that say what is accepted, and no grammar makes a mask step tokenize more than
# MAX_FORCED_BYTES of forced text (refused at compile time when the run is at its start, the row stopped later).
import json
import os
import re
import subprocess
import sys
import time

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

import invariants
import models
from engines import constraints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAD = 13   # the model's logits are wider than the tokenizer (as Qwen's are): those ids must never be allowed


@pytest.fixture(scope="module")
def tiny():
    return models.load_tokenizer(models.tiny_model_dir())


@pytest.fixture(scope="module")
def smollm2():
    return models.load_tokenizer(models.resolve_model("smollm2"))


def walk(spec: str, tokenizer, seed: int, stop: int | None = None, max_steps: int = 4000):
    """Sample uniformly among the allowed ids (seeded) until the stop id; returns (ids, masks seen, bound spec)."""
    stop = tokenizer.eos_token_id if stop is None else stop
    bound = constraints.bind(spec, [stop])
    vocab = len(tokenizer) + PAD
    m, generator, ids, masks = constraints.matcher(bound, tokenizer, vocab), torch.Generator().manual_seed(seed), [], []
    while not ids or ids[-1] != stop:
        assert len(ids) < max_steps, f"the walk did not reach the stop in {max_steps} tokens"
        masks.append(m.allowed())
        choices = masks[-1].nonzero().flatten()
        ids.append(int(choices[torch.randint(len(choices), (1,), generator=generator)]))
        m.accept(ids[-1])
    return ids, torch.stack(masks), bound


def enforced_schema(spec: str) -> dict:
    return json.loads(json.loads(spec)["schema"])


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["ok"]}},
    "required": ["city", "unit"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["value"]}}, "$ref": "#/$defs/node"}
UNION = {"anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": ["integer", "null"]}},
                    "required": ["kind", "n"]},
                   {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, "two", None]}], "minItems": 2,
                    "items": False}]}
FORMATS = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                            "when": {"type": "string", "format": "date"},
                                            "n": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99}},
           "required": ["code", "when", "n"]}
OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}   # strict=False: extra properties allowed
SPECS = {"weather": lambda: constraints.json_schema_spec(WEATHER), "tree": lambda: constraints.json_schema_spec(TREE),
         "union": lambda: constraints.json_schema_spec(UNION), "formats": lambda: constraints.json_schema_spec(FORMATS),
         "open": lambda: constraints.json_schema_spec(OPEN, strict=False), "json_object": constraints.json_object_spec}
SCHEMAS = {"weather": WEATHER, "tree": TREE, "union": UNION, "formats": FORMATS, "open": OPEN,
           "json_object": {"type": "object"}}


# ---- walks: what a constrained engine can produce ----

@pytest.mark.parametrize("name", list(SPECS))
def test_constrained_walks_always_end_in_json_valid_for_the_schema(tiny, name):
    spec = SPECS[name]()
    checker = jsonschema.FormatChecker()
    for seed in range(6):
        ids, _, _ = walk(spec, tiny, seed)
        text = tiny.decode(ids[:-1])
        value = json.loads(text)
        jsonschema.validate(value, SCHEMAS[name], format_checker=checker)
        jsonschema.validate(value, enforced_schema(spec), format_checker=checker)   # strict: no undeclared keys
        assert "\n" not in text, text   # one line: a raw newline could only be whitespace between tokens of JSON


def test_strict_walks_never_write_undeclared_properties_and_open_ones_do(tiny):
    # the trap is armed: the same schema without strict lets the walk add keys, so the strict check can fail
    strict = constraints.json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert enforced_schema(strict)["additionalProperties"] is False
    open_spec, extra = constraints.json_schema_spec(OPEN, strict=False), []
    for seed in range(12):
        assert set(json.loads(tiny.decode(walk(strict, tiny, seed)[0][:-1]))) <= {"a"}
        extra += set(json.loads(tiny.decode(walk(open_spec, tiny, seed)[0][:-1])))
    assert set(extra) - {"a"}


def test_walks_on_smollm2s_tokenizer_validate_too(smollm2):
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                               "city": {"type": "string", "maxLength": 6}},
              "required": ["unit", "ok", "days", "city"]}
    spec = constraints.json_schema_spec(schema)
    for seed in range(3):
        ids, masks, bound = walk(spec, smollm2, seed)
        jsonschema.validate(json.loads(smollm2.decode(ids[:-1])), schema)
        assert torch.equal(constraints.replay_masks(bound, smollm2, ids, len(smollm2) + PAD), masks)


def test_masks_allow_no_special_token_but_the_stop_and_no_id_past_the_tokenizer(tiny):
    specials = set(tiny.all_special_ids) | {i for i, t in tiny.added_tokens_decoder.items() if t.special}
    for name in ("weather", "union"):
        ids, masks, _ = walk(SPECS[name](), tiny, seed=1)
        assert not masks[:, len(tiny):].any()                     # padded logits columns: never
        for i in specials - {tiny.eos_token_id}:
            assert not masks[:, i].any(), tiny.convert_ids_to_tokens(i)
        # the stop is the one special id allowed, and only where the JSON is complete (here: the last step only);
        # seeing it allowed there shows these checks look at special columns at all
        assert masks[-1, tiny.eos_token_id] and not masks[:-1, tiny.eos_token_id].any()
        assert masks[-1].nonzero().flatten().tolist() == [tiny.eos_token_id]


# ---- replay: what the trainer applies ----

@pytest.mark.parametrize("name", ["weather", "tree", "json_object"])
def test_replay_masks_equal_the_masks_the_walk_sampled_under(tiny, name):
    for seed in range(3):
        ids, masks, bound = walk(SPECS[name](), tiny, seed)
        replayed = constraints.replay_masks(bound, tiny, ids, len(tiny) + PAD)
        assert replayed.dtype == torch.bool and replayed.shape == (len(ids), len(tiny) + PAD)
        assert torch.equal(replayed, masks)
        assert torch.equal(constraints.replay_masks(bound, tiny, ids[:5], len(tiny) + PAD), masks[:5])
    assert constraints.replay_masks(bound, tiny, [], len(tiny) + PAD).shape == (0, len(tiny) + PAD)


def test_a_row_that_leaves_its_grammar_is_refused_by_position(tiny):
    vocab = len(tiny) + PAD
    ids, masks, bound = walk(SPECS["weather"](), tiny, seed=2)
    k = len(ids) // 2
    outside = int((~masks[k]).nonzero().flatten()[0])
    with pytest.raises(ValueError, match=f"token id {outside} at generated position {k} is not allowed"):
        constraints.replay_masks(bound, tiny, ids[:k] + [outside] + ids[k + 1:], vocab)
    with pytest.raises(ValueError, match=f"position {len(ids)} .*already ended at its stop id"):
        constraints.replay_masks(bound, tiny, ids + [ids[0]], vocab)          # nothing may follow the stop
    with pytest.raises(ValueError, match="not allowed"):
        constraints.replay_masks(bound, tiny, ids[:k] + [vocab + 5], vocab)   # an id outside the logits
    m = constraints.matcher(bound, tiny, vocab)
    with pytest.raises(ValueError, match="position 0"):
        m.accept(tiny.eos_token_id)   # the stop before any JSON


def test_matchers_are_independent_rows(tiny):
    bound = constraints.bind(SPECS["weather"](), [tiny.eos_token_id])
    vocab = len(tiny) + PAD
    first = constraints.matcher(bound, tiny, vocab)
    second = constraints.matcher(bound, tiny, vocab)
    start = second.allowed()
    for token_id in tiny.encode('{"city": "Pa', add_special_tokens=False):
        first.accept(token_id)
    assert torch.equal(second.allowed(), start) and not torch.equal(first.allowed(), start)


def test_matcher_refuses_an_unbound_spec_a_foreign_spec_and_a_narrow_vocabulary(tiny):
    with pytest.raises(ValueError, match="not bound to stop ids"):
        constraints.matcher(constraints.json_object_spec(), tiny, len(tiny))
    with pytest.raises(ValueError, match="not a constraint spec"):
        constraints.matcher('{"type":"object"}', tiny, len(tiny))
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        constraints.matcher(constraints.bind(constraints.json_object_spec(), [2]), tiny, len(tiny) - 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        constraints.matcher(constraints.bind(constraints.json_object_spec(), [len(tiny) + 1]), tiny, len(tiny))


# ---- forced tool calls ----

TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                              "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "ping"}},   # no parameters: any object
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def parse_tool_call(text: str) -> dict:
    assert text.endswith(constraints.TOOL_CALL_SUFFIX), text
    call = json.loads(text[:-len(constraints.TOOL_CALL_SUFFIX)])
    assert list(call) == ["name", "arguments"], text   # "name" first, as the chat template renders a call
    return call


def test_tool_call_walks_parse_as_a_call_of_a_listed_tool_with_valid_arguments(tiny):
    spec, parameters, names = constraints.tool_call_spec(TOOLS), {}, []
    for tool in TOOLS:
        parameters[tool["function"]["name"]] = tool["function"].get("parameters", {"type": "object"})
    for seed in range(12):
        call = parse_tool_call(tiny.decode(walk(spec, tiny, seed)[0][:-1]))
        jsonschema.validate(call["arguments"], parameters[call["name"]])
        if call["name"] == "get_weather":   # strict: only the declared keys
            assert set(call["arguments"]) <= {"city", "unit"}
        names.append(call["name"])
    assert set(names) == set(parameters)   # every tool is reachable


def test_a_named_tool_call_calls_only_that_tool(tiny, smollm2):
    for tokenizer in (tiny, smollm2):
        spec = constraints.tool_call_spec(TOOLS, name="get_weather")
        for seed in range(3):
            call = parse_tool_call(tokenizer.decode(walk(spec, tokenizer, seed)[0][:-1]))
            assert call["name"] == "get_weather"
            jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])


def test_the_tool_call_suffix_takes_the_tokenizers_own_closing_token(tiny):
    # the tiny tokenizer (like Qwen's) has "</tool_call>" as one added token: a taught model emits that id, so
    # the grammar must allow it, and the spelled-out text too
    bound = constraints.bind(constraints.tool_call_spec(TOOLS, name="ping"), [tiny.eos_token_id])
    closing = tiny.convert_tokens_to_ids("</tool_call>")
    text = '{"name": "ping", "arguments": {}}\n</tool_call>'
    ids = tiny.encode(text, add_special_tokens=False) + [tiny.eos_token_id]
    assert closing in ids
    masks = constraints.replay_masks(bound, tiny, ids, len(tiny))
    assert masks[-1].nonzero().flatten().tolist() == [tiny.eos_token_id]
    spelled = tiny.encode(text[:-len("</tool_call>")], add_special_tokens=False)
    spelled += [tiny.convert_tokens_to_ids(c) for c in "</tool_call>"] + [tiny.eos_token_id]   # byte by byte
    assert constraints.replay_masks(bound, tiny, spelled, len(tiny)).shape[0] == len(spelled)


# ---- a response format with tools offered (tool_choice auto): its JSON, or tool calls ----

CALLABLE = [TOOLS[0], TOOLS[2]]   # bounded arguments: a uniform walk ends in a few hundred tokens


def parse_reply(text: str, schema: dict) -> tuple[str, list[dict]]:
    """("json", []) for JSON valid for the schema, ("calls", calls) for Hermes tool calls of CALLABLE's tools with
    valid arguments joined by "\n"; anything else fails."""
    if not text.startswith("<tool_call>"):
        jsonschema.validate(json.loads(text), schema)
        return "json", []
    pieces = ("\n" + text).split("\n" + constraints.TOOL_CALL_OPENING)   # JSON in this layout holds no raw "\n"
    assert pieces[0] == "" and len(pieces) > 1, text
    parameters, calls = {t["function"]["name"]: t["function"]["parameters"] for t in CALLABLE}, []
    for block in pieces[1:]:
        calls.append(parse_tool_call(block))
        jsonschema.validate(calls[-1]["arguments"], parameters[calls[-1]["name"]])
    return "calls", calls


@pytest.mark.parametrize("parallel", [True, False])
def test_a_format_with_tools_offered_walks_to_its_json_or_to_calls_of_listed_tools(tiny, parallel):
    spec = constraints.with_tool_calls(constraints.json_schema_spec(WEATHER), CALLABLE, parallel)
    branches, counts, opening = set(), set(), tiny.convert_tokens_to_ids("<tool_call>")
    for seed in range(16):
        ids, masks, bound = walk(spec, tiny, seed)
        assert masks[0][opening]                    # the opening is the model's own token to sample, not forced
        branch, calls = parse_reply(tiny.decode(ids[:-1]), WEATHER)
        branches.add(branch)
        counts.add(len(calls))
        assert torch.equal(constraints.replay_masks(bound, tiny, ids, len(tiny) + PAD), masks)
    assert branches == {"json", "calls"}            # both reached
    assert (max(counts) > 1) == parallel            # several calls only when parallel; one call exactly otherwise


def test_a_format_with_tools_takes_the_tokenizers_own_tool_call_tokens_and_refuses_json_after_a_call(tiny):
    spec = constraints.bind(constraints.with_tool_calls(constraints.json_object_spec(), CALLABLE, True),
                            [tiny.eos_token_id])
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    one = constraints.TOOL_CALL_OPENING + call + constraints.TOOL_CALL_SUFFIX
    ids = tiny.encode(one + "\n" + one, add_special_tokens=False) + [tiny.eos_token_id]
    assert {tiny.convert_tokens_to_ids("<tool_call>"), tiny.convert_tokens_to_ids("</tool_call>")} <= set(ids)
    assert constraints.replay_masks(spec, tiny, ids, len(tiny)).shape[0] == len(ids)
    spelled = [tiny.convert_tokens_to_ids(c) for c in "<tool_call>"] + tiny.encode(one[len("<tool_call>"):],
                                                                                    add_special_tokens=False)
    assert constraints.replay_masks(spec, tiny, spelled + [tiny.eos_token_id], len(tiny)).shape[0] == len(spelled) + 1
    for bad in (one + "\n" + '{"a": 1}', '{"a": 1}' + "\n" + one, one.replace('"add"', '"rm"')):
        with pytest.raises(ValueError, match="not allowed by the grammar"):
            constraints.replay_masks(spec, tiny, tiny.encode(bad, add_special_tokens=False), len(tiny))
    with pytest.raises(ValueError, match="not allowed by the grammar"):   # not parallel: one call, then the stop
        constraints.replay_masks(constraints.bind(constraints.with_tool_calls(constraints.json_object_spec(),
                                                                              CALLABLE, False), [2]), tiny, ids, len(tiny))


# ---- specs ----

def test_specs_are_canonical_deterministic_and_bind_round_trips(tiny):
    a = constraints.json_schema_spec(WEATHER)
    assert a == constraints.json_schema_spec(json.loads(json.dumps(WEATHER)))
    fields = json.loads(a)
    assert list(fields) == sorted(fields) and a == json.dumps(fields, sort_keys=True, separators=(",", ":"))
    # equal constraints are equal strings: strict mode is the explicit additionalProperties: false
    explicit = {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}
    assert constraints.json_schema_spec(explicit, strict=False) == constraints.json_schema_spec(
        {"type": "object", "properties": {"x": {"type": "integer"}}})
    # property order is part of the constraint: the grammar writes keys in the schema's order
    ab = {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}, "required": ["a", "b"]}
    ba = {"type": "object", "properties": {"b": {"const": 2}, "a": {"const": 1}}, "required": ["a", "b"]}
    assert constraints.json_schema_spec(ab) != constraints.json_schema_spec(ba)
    assert tiny.decode(walk(constraints.json_schema_spec(ba), tiny, 0)[0][:-1]) == '{"b": 2, "a": 1}'
    bound = constraints.bind(a, (7, 2, 2))
    assert json.loads(bound)["stop"] == [2, 7] and constraints.bind(bound, [2, 7]) == bound
    assert {k: v for k, v in json.loads(bound).items() if k != "stop"} == fields
    rows = {invariants.Sampling(constraint=constraints.bind(constraints.json_schema_spec(WEATHER), [7, 2]))
            for _ in range(3)}
    assert len(rows) == 1   # hashable inside the frozen Sampling, and equal across rebuilds
    for bad in ([], [-1], "2", [True], [2.0]):
        with pytest.raises(ValueError, match="non-empty sequence of non-negative int stop ids"):
            constraints.bind(a, bad)
    union = constraints.with_tool_calls(a, TOOLS, True)
    assert union == constraints.with_tool_calls(constraints.json_schema_spec(json.loads(json.dumps(WEATHER))),
                                                json.loads(json.dumps(TOOLS)), True)
    assert json.loads(union)["tools"] == json.loads(constraints.tool_call_spec(TOOLS))["schema"]
    assert list(json.loads(union)) == sorted(json.loads(union)) and union != constraints.with_tool_calls(a, TOOLS, False)


def test_a_bound_spec_rebuilds_the_same_masks_in_another_process(tiny, tmp_path):
    # the trainer may be a Ray actor: the spec text alone (plus its own tokenizer) must give the engine's masks
    ids, masks, bound = walk(SPECS["tree"](), tiny, seed=3)
    job = {"spec": bound, "ids": ids, "vocab": len(tiny) + PAD, "out": str(tmp_path / "masks.pt")}
    code = ("import json, sys, torch, models; from engines import constraints; job = json.loads(sys.argv[1]); "
            "tok = models.load_tokenizer(models.tiny_model_dir()); "
            "torch.save(constraints.replay_masks(job['spec'], tok, job['ids'], job['vocab']), job['out'])")
    subprocess.run([sys.executable, "-c", code, json.dumps(job)], cwd=ROOT, check=True, timeout=300)
    assert torch.equal(torch.load(job["out"]), masks)


# ---- refusals: hostile or unsupported requests cost little and say what is accepted ----

def _deep(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _one_tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


SCHEMA, TOOL_CALL = constraints.json_schema_spec, constraints.tool_call_spec
ATTACKS = {   # name: (the spec function, a builder of its arguments (built outside the timer), the message)
    "1 MB schema": (SCHEMA, lambda: ({"type": "object", "properties": {
        f"k{i}": {"type": "string", "description": "x" * 5000} for i in range(200)}},), r"1\d{6} characters .* 65536"),
    "100,000 levels deep": (SCHEMA, lambda: (_deep(100_000),), "nested deeper than 32 levels"),
    "50,000 enum values": (SCHEMA, lambda: ({"enum": list(range(50_000))},), "more than 16384 JSON values"),
    "2,000 optional properties": (SCHEMA, lambda: ({"type": "object",
                                                     "properties": {f"k{i}": {} for i in range(2000)}},),
                                  r"breadth of 2000 \(optional properties, plus 2 per anyOf/oneOf/allOf branch\), "
                                  r"more than 256"),
    "invalid type": (SCHEMA, lambda: ({"type": "strnig"},), "engine can enforce: Invalid type: strnig"),
    "invalid required": (SCHEMA, lambda: ({"type": "object", "required": "a"},), "Expected array for 'required'"),
    "not": (SCHEMA, lambda: ({"not": {"type": "string"}},), r'Unimplemented keys: \["not"\].*Enforced are type'),
    "if/then": (SCHEMA, lambda: ({"if": {"type": "string"}, "then": {"maxLength": 2}},), "Unimplemented keys"),
    "overlapping oneOf": (SCHEMA, lambda: ({"oneOf": [{"type": "integer"}, {"type": "number"}]},), "oneOf"),
    "remote $ref": (SCHEMA, lambda: ({"$ref": "http://example.com/s.json"},), "engine can enforce"),
    "missing $ref": (SCHEMA, lambda: ({"$ref": "#/$defs/nope"},), "does not exist"),
    "a list": (SCHEMA, lambda: ([{"type": "string"}],), "must be a JSON object"),
    "NaN": (SCHEMA, lambda: ({"type": "number", "maximum": float("nan")},), "finite numbers"),
    "engine options": (SCHEMA, lambda: ({"x-guidance": {"lenient": True}, "not": {}},), "x-guidance"),
    "strict flag": (SCHEMA, lambda: ({"type": "object"}, "yes"), "true or false"),
    "unknown tool": (TOOL_CALL, lambda: ([_one_tool("a"), _one_tool("b")], "c"),
                     r"'c', which is not among the tools \['a', 'b'\]"),
    "duplicate tool": (TOOL_CALL, lambda: ([_one_tool("a"), _one_tool("a")],), "used twice"),
    "malformed tool": (TOOL_CALL, lambda: ([{"type": "function", "name": "a"}],), r"tools\[0\] must be"),
    "no tools": (TOOL_CALL, lambda: ([],), "non-empty list"),
    "bad parameters": (TOOL_CALL, lambda: ([_one_tool("a"), _one_tool("b", {"type": "strnig"})],),
                       r"tools\[1\]\.function\.parameters is not a JSON Schema the grammar engine can"),
    "calls on a forced call": (constraints.with_tool_calls, lambda: (TOOL_CALL([_one_tool("a")]), [_one_tool("a")],
                                                                     True), "takes an unbound response format spec"),
    "calls twice": (constraints.with_tool_calls, lambda: (constraints.with_tool_calls(
        constraints.json_object_spec(), [_one_tool("a")], True), [_one_tool("a")], True), "unbound response format"),
    "calls without tools": (constraints.with_tool_calls, lambda: (constraints.json_object_spec(), [], True),
                            "non-empty list"),
    "tools too large together": (TOOL_CALL, lambda: ([_one_tool(f"t{i}", {"type": "object", "properties": {
        f"p{j}": {"type": "integer"} for j in range(100)}}) for i in range(12)],),
                                 r"the tools up to tools\[2\] come to a breadth of 306 .* name the one to call"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_or_unsupported_requests_are_refused_quickly_with_the_reason(name):
    spec_function, arguments, message = ATTACKS[name]
    arguments = arguments()
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        spec_function(*arguments)
    assert time.perf_counter() - start < 1.0


def test_schemas_at_the_bounds_walk_within_the_grammar_engines_limits(smollm2):
    # the widest shapes the breadth bound admits: one object of optional properties, a union of open objects, an
    # array of a union of objects (every branch's properties open at each item)
    n = constraints.MAX_SCHEMA_BREADTH
    shapes = [{"type": "object", "properties": {f"k{i:03d}": {"type": "boolean"} for i in range(n)}},
              {"anyOf": [{"type": "object", "description": f"shape {j}"} for j in range(n // 2)]},
              {"type": "array", "maxItems": 2, "items": {"anyOf": [{"type": "object", "properties": {
                  f"k{j}_{i}": {"type": "boolean"} for i in range(n // 8 - 2)}} for j in range(8)]}}]
    for schema in shapes:
        spec = constraints.json_schema_spec(schema, strict=False)
        for seed in range(2):
            ids, _, _ = walk(spec, smollm2, seed, max_steps=20_000)
            jsonschema.validate(json.loads(smollm2.decode(ids[:-1])), schema)
    # the trap is armed: past the bound (twice the optional properties, the bound's check skipped) the grammar
    # engine stops in the first tokens, which a row would then fail on
    wide = {"type": "object", "properties": {f"k{i:03d}": {"type": "boolean"} for i in range(2 * n)}}
    with pytest.raises(ValueError, match="breadth of 512"):
        constraints.json_schema_spec(wide, strict=False)
    with pytest.raises(ValueError, match=r"position \d+ is not allowed .*max is 2000"):
        walk(constraints._spec("json_schema", wide, ""), smollm2, seed=0)


def test_a_format_and_tools_each_at_the_bound_walk_together_within_the_engines_limits(smollm2):
    # the tools' calls open only after "<tool_call>", so the two bounds do not add up at one step
    n = constraints.MAX_SCHEMA_BREADTH
    wide = {"type": "object", "properties": {f"k{i:03d}": {"type": "boolean"} for i in range(n)}}
    tools = [{"type": "function", "function": {"name": f"t{j}", "strict": True, "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(n // 4 - 2)}}}} for j in range(4)]
    spec, branches = constraints.with_tool_calls(constraints.json_schema_spec(wide, strict=False), tools, True), set()
    for seed in range(4):
        text = smollm2.decode(walk(spec, smollm2, seed, max_steps=20_000)[0][:-1])
        branches.add(text.startswith(constraints.TOOL_CALL_OPENING))
        if not text.startswith("<"):
            jsonschema.validate(json.loads(text), wide)
    assert branches == {True, False}


def test_schema_text_cannot_escape_its_place_in_the_grammar(tiny):
    # property names and constants that look like Lark or JSON syntax stay data: the walk writes them verbatim
    name = 'a"}\nstart: "x" | %json {'
    schema = {"type": "object", "properties": {name: {"const": "} <[2]> \"\n"}}, "required": [name]}
    ids, _, _ = walk(constraints.json_schema_spec(schema), tiny, seed=0)
    assert json.loads(tiny.decode(ids[:-1])) == {name: "} <[2]> \"\n"}


# ---- the per-token bound: the text a grammar forces ahead, which llguidance tokenizes again at every mask ----

ATTACK = {"type": "string", "pattern": "^a{100000}$"}   # the issue's: 27 ms of server CPU per token, 2 ms without


def over_the_bound() -> str:
    """A refusal's text past its place: the run's length, and the bound it is over."""
    return rf"forces (\d+) bytes of text in a row, more than {constraints.MAX_FORCED_BYTES}: the grammar engine"


def _unchecked(schema: dict) -> str:
    """The spec json_schema_spec made before the bound: its checks skipped (another process's, or an old one)."""
    return constraints._spec("json_schema", schema, "")


def forced_runs(bound: str, tokenizer, ids: list[int]) -> list[int]:
    """The forced run (bytes) before each of `ids`: the text llguidance tokenizes again to make that step's mask."""
    m, runs = constraints.matcher(bound, tokenizer, len(tokenizer) + PAD), []
    for token_id in ids:
        runs.append(len(m._ll.compute_ff_bytes().split(b"\xff")[0]))   # the text, not a forced stop id's marker
        m.accept(token_id)
    return runs


def test_the_attack_forces_a_hundred_times_the_bound_at_every_mask_step(smollm2):
    # the trap is armed: built as before the bound, each mask of the attack allows one forced token, which
    # llguidance finds by tokenizing the whole run ahead again: ~100,000 bytes a step (27 ms), 0.2 ms at the bound
    bound = constraints.bind(_unchecked(ATTACK), [smollm2.eos_token_id])
    ll = llguidance.LLMatcher(constraints._ll_tokenizer(smollm2, len(smollm2)),
                              constraints.lark_grammar(bound, smollm2), log_level=0)
    for _ in range(6):
        assert len(ll.compute_ff_bytes()) > 95 * constraints.MAX_FORCED_BYTES
        allowed = constraints._unpack(np.frombuffer(ll.compute_bitmask(), np.uint8)[None], len(smollm2))[0]
        assert allowed.sum() == 1
        assert ll.consume_token(int(allowed.nonzero()[0, 0]))


def test_the_attack_is_refused_at_compile_time_and_where_a_row_would_start(smollm2):
    with pytest.raises(ValueError, match=r"the JSON schema, from its start, " + over_the_bound()) as refused:
        constraints.json_schema_spec(ATTACK)
    assert re.search(over_the_bound(), str(refused.value)).group(1) == "100002"   # '"', 100,000 a, '"'
    # a spec that skipped the check (built elsewhere) is refused where the engine builds a row's matcher
    with pytest.raises(ValueError, match="the constraint, from its start, " + over_the_bound()):
        constraints.matcher(constraints.bind(_unchecked(ATTACK), [smollm2.eos_token_id]), smollm2, len(smollm2))


def test_the_bound_is_exact_and_the_same_at_compile_time_and_where_a_row_starts(smollm2, monkeypatch):
    # at the bound the walk is one forced run of exactly MAX_FORCED_BYTES (SmolLM2 spells the tool-call suffix
    # out), which both checks accept; one byte more, both refuse
    n = constraints.MAX_FORCED_BYTES
    head, tail = '{"name": "t", "arguments": {"k": "', '"}}' + constraints.TOOL_CALL_SUFFIX
    at_the_bound = {
        "schema": lambda extra: constraints.json_schema_spec({"type": "string", "pattern": f"^a{{{n - 2 + extra}}}$"}),
        "tool call": lambda extra: TOOL_CALL([_strict_tool("t", {"type": "object", "required": ["k"], "properties": {
            "k": {"type": "string", "pattern": f"^a{{{n - len(head) - len(tail) + extra}}}$"}}})])}
    for name, spec in at_the_bound.items():
        ids, _, bound = walk(spec(0), smollm2, seed=0)
        assert forced_runs(bound, smollm2, ids)[0] == n, name
        with pytest.raises(ValueError, match=f"from its start, forces {n + 1} bytes of text in a row, more than {n}"):
            spec(1)
        with monkeypatch.context() as patched:   # built where the bound was a byte looser (elsewhere, or earlier)
            patched.setattr(constraints, "MAX_FORCED_BYTES", n + 1)
            over = constraints.bind(spec(1), [smollm2.eos_token_id])
        with pytest.raises(ValueError, match=f"the constraint, from its start, forces {n + 1} bytes"):
            constraints.matcher(over, smollm2, len(smollm2))


def _strict_tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "strict": True, "parameters": parameters}}


REQUIRED_ATTACK = {"type": "object", "properties": {"k": ATTACK}, "required": ["k"]}
FORCED_FROM_THE_START = {   # a cheap attacker's variants: name: (spec function, its arguments, who is named)
    "nested quantifiers (a{1000}){100}": (SCHEMA, lambda: ({"type": "string", "pattern": "^(a{1000}){100}$"},),
                                          "the JSON schema"),
    "the attack in a required property": (SCHEMA, lambda: (REQUIRED_ATTACK,), "the JSON schema"),
    "a 60,000-character constant": (SCHEMA, lambda: ({"const": "a" * 60_000},), "the JSON schema"),
    "1,000 items of a 1,000-character constant": (SCHEMA, lambda: ({"type": "array", "items": {"const": "a" * 1000},
                                                                    "minItems": 1000},), "the JSON schema"),
    "the attack as a tool's argument": (TOOL_CALL, lambda: ([_strict_tool("t", REQUIRED_ATTACK)],),
                                        r"tools\[0\]\.function\.parameters"),
    "a 5,000-character tool name": (TOOL_CALL, lambda: ([_one_tool("t" * 5000)],), "the tool call"),
}


@pytest.mark.parametrize("name", list(FORCED_FROM_THE_START))
def test_variants_forcing_a_long_run_from_the_start_are_refused_at_compile_time(name):
    spec_function, arguments, where = FORCED_FROM_THE_START[name]
    with pytest.raises(ValueError, match=where + ", from its start, " + over_the_bound()):
        spec_function(*arguments())


AFTER_A_CHOICE = {   # variants whose run starts after the model chose something: no compile-time walk sees them
    "after one of two branches": {"anyOf": [{"const": "b" + "a" * 5000}, {"const": "c" + "a" * 5000}]},
    "after a free integer": {"type": "object", "properties": {"n": {"type": "integer"}, "k": ATTACK},
                             "required": ["n", "k"]},
}


@pytest.mark.parametrize("name", list(AFTER_A_CHOICE))
def test_a_long_run_after_a_choice_stops_the_row_where_it_starts_and_the_replay_agrees(tiny, name):
    # the row stops at the first step whose forced run is over the bound, before that step's mask (which would
    # tokenize the run); deterministic, so the trainer's replay refuses the same position
    bound = constraints.bind(constraints.json_schema_spec(AFTER_A_CHOICE[name]), [tiny.eos_token_id])
    vocab, ids = len(tiny) + PAD, []
    m = constraints.matcher(bound, tiny, vocab)
    with pytest.raises(ValueError, match=r"the grammar after (\d+) tokens " + over_the_bound()) as stopped:
        for _ in range(100):
            ids.append(int(m.allowed().nonzero()[0, 0]))   # the lowest allowed id
            m.accept(ids[-1])
    assert 0 < len(ids) < 100 and re.search(r"after (\d+) tokens", str(stopped.value)).group(1) == str(len(ids))
    with pytest.raises(ValueError, match=rf"the grammar after {len(ids)} tokens " + over_the_bound()):
        constraints.replay_masks(bound, tiny, ids + [0], vocab)


def test_large_alternations_long_enums_and_deep_nesting_stay_far_under_the_bound(smollm2):
    # accepted within the schema bounds, and cheap: no forced run near the bound (the lexer's own work per step is
    # llguidance's fuel-bounded); a size past the schema bounds is refused before any grammar is built
    def alternation(n): return {"type": "string", "pattern": "^(" + "|".join(f"w{i:05d}x" for i in range(n)) + ")$"}
    def enum(n): return {"enum": [f"value number {i}" for i in range(n)]}
    def deep(levels):   # each level is two containers deep: "properties" and the property's schema
        schema = {"type": "integer"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema
    for past_the_bounds, refusal in ((alternation(10_000), "characters of JSON, more than 65536"),
                                     (enum(20_000), "more than 16384 JSON values"),
                                     (deep(constraints.MAX_SCHEMA_DEPTH // 2), "nested deeper than 32 levels")):
        with pytest.raises(ValueError, match=refusal):
            constraints.json_schema_spec(past_the_bounds)
    for schema in (alternation(3000), enum(3000), deep(constraints.MAX_SCHEMA_DEPTH // 2 - 1)):
        spec = constraints.json_schema_spec(schema)
        for seed in range(2):
            ids, _, bound = walk(spec, smollm2, seed)
            jsonschema.validate(json.loads(smollm2.decode(ids[:-1])), schema)
            assert max(forced_runs(bound, smollm2, ids)) <= constraints.MAX_FORCED_BYTES // 4


def test_ordinary_grammars_force_a_few_dozen_bytes_at_most(tiny):
    specs = {**SPECS, "tool call": lambda: TOOL_CALL(TOOLS), "json or calls": lambda: constraints.with_tool_calls(
        constraints.json_schema_spec(WEATHER), CALLABLE, True)}
    longest = {}
    for name, spec in specs.items():
        for seed in range(3):
            ids, _, bound = walk(spec(), tiny, seed)
            longest[name] = max(longest.get(name, 0), *forced_runs(bound, tiny, ids))
    assert max(longest.values()) <= constraints.MAX_FORCED_BYTES // 16, longest


# ---- the memory bound: a row's lexer states ----

GROWING = {"type": "object", "required": ["k"], "properties": {"k": {"type": "string", "pattern": "^[a-z]*(" + "|".join(
    f"{chr(97 + j)}[a-z]{{{7 * j % 20}}}" for j in range(26)) + ")$"}}}   # a new state for each new 20-letter window


def hostile_walk(m: constraints.Matcher, tokenizer, steps: int) -> list[int]:
    """A hostile row of `steps` tokens: a seeded draw among the allowed ids, never one that would close the string
    (a quote, a backslash, the stop) while another is allowed."""
    closing = torch.tensor([i >= len(tokenizer) or i == tokenizer.eos_token_id or '"' in tokenizer.decode([i])
                            or "\\" in tokenizer.decode([i]) for i in range(m.vocab_size)])
    ids, generator = [], torch.Generator().manual_seed(0)
    for _ in range(steps):
        allowed = m.allowed()
        choices = (allowed & ~closing if (allowed & ~closing).any() else allowed).nonzero().flatten()
        ids.append(int(choices[torch.randint(len(choices), (1,), generator=generator)]))
        m.accept(ids[-1])
    return ids


def test_a_rows_lexer_states_stop_it_at_the_same_token_in_the_engine_and_the_replay_whatever_ran_before(
        tiny, monkeypatch):
    bound = constraints.bind(constraints.json_schema_spec(GROWING), [tiny.eos_token_id])
    vocab = len(tiny) + PAD
    with pytest.raises(ValueError, match=r"the grammar stopped after (\d+) tokens: lexer error: too many states.*"
                                         r"MAX_LEXER_STATES") as stopped:
        hostile_walk(constraints.matcher(bound, tiny, vocab), tiny, 20_000)
    k = int(re.search(r"after (\d+) tokens", str(stopped.value)).group(1))
    assert 50 < k < 5_000
    ids = hostile_walk(constraints.matcher(bound, tiny, vocab), tiny, k)   # the same row, up to the cap
    hostile_walk(constraints.matcher(bound, tiny, vocab), tiny, k // 2)    # another row of the spec in between
    constraints.replay_masks(bound, tiny, ids, vocab)                      # replays to the cap exactly
    with pytest.raises(ValueError, match=f"the grammar stopped after {k} tokens: lexer error: too many states"):
        constraints.replay_masks(bound, tiny, ids + [ids[-1]], vocab)
    # armed: the cap is what stops it; at llguidance's default the same row walks on
    monkeypatch.setattr(constraints, "LIMITS", llguidance.LLParserLimits())
    assert len(hostile_walk(constraints.matcher(bound, tiny, vocab), tiny, k + 100)) == k + 100
