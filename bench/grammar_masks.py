# bench/grammar_masks.py — what a grammar costs the engine: its build, and a mask and an accept per token.
#
# Over a real tokenizer (SmolLM2's by default, or any model models.resolve_model takes): the llguidance tokenizer's
# one-time build, then for each spec (a JSON object, a schema, forced tool calls, a schema or tool calls, and specs
# at each of engines/constraints.py's bounds: breadth, depth, a long pattern, MAX_FORCED_BYTES of forced text) its
# matcher's build, a uniform random walk of up to 256 allowed ids timing the mask and the accept of each token (mean,
# p99, max), and the replay per token the trainer pays; last, how fast a pattern past MAX_FORCED_BYTES is refused.
#
#   python bench/grammar_masks.py [MODEL]
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import models  # noqa: E402
from engines.constraints import (MAX_FORCED_BYTES, MAX_SCHEMA_BREADTH, _check_schema, _ll_tokenizer,  # noqa: E402
                                 bind, json_object_spec, json_schema_spec, matcher, replay_masks, tool_call_spec,
                                 with_tool_calls)

tokenizer = models.load_tokenizer(models.resolve_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2"))
vocab, stop = len(tokenizer), [tokenizer.eos_token_id]
start = time.perf_counter()
_ll_tokenizer(tokenizer, vocab)
print(f"tokenizer ({vocab} ids): {time.perf_counter() - start:.3f} s, once per tokenizer")
weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit"]}
tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": weather}} for i in range(8)]
n = MAX_SCHEMA_BREADTH
wide = {"type": "object", "properties": {f"k{i:04d}": {"type": "string"} for i in range(n)}}
union = {"anyOf": [{"type": "object", "description": f"shape {j}"} for j in range(n // 2)]}
items = {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {
    f"k{j}_{i}": {"type": "integer"} for i in range(n // 8 - 2)}} for j in range(8)]}}
deep = {"type": "integer"}
while True:   # the deepest chain of nested objects the depth bound takes
    deeper = {"type": "object", "properties": {"a": deep, "b": {"type": "string", "maxLength": 64}}}
    try:
        _check_schema(deeper, "deep")
    except ValueError:
        break
    deep = deeper
cases = {"json_object": json_object_spec(), "weather schema": json_schema_spec(weather),
         "8 tools": tool_call_spec(tools), "weather schema or 8 tools' calls": with_tool_calls(
             json_schema_spec(weather), tools, True), f"{n} optional properties": json_schema_spec(wide, strict=False),
         f"a union of {n // 2} open objects": json_schema_spec(union, strict=False),
         "an array of a union of 8 objects": json_schema_spec(items, strict=False),
         "deepest nesting, maxLength 64 each": json_schema_spec(deep),
         "pattern ^([a-z]{1,64}\\.){1,64}[a-z]{2,8}$":
         json_schema_spec({"type": "string", "pattern": "^([a-z]{1,64}\\.){1,64}[a-z]{2,8}$"}),
         f"pattern ^a{{{MAX_FORCED_BYTES - 2}}}$ (forcing MAX_FORCED_BYTES)":
         json_schema_spec({"type": "string", "pattern": f"^a{{{MAX_FORCED_BYTES - 2}}}$"})}
for name, spec in cases.items():
    bound = bind(spec, stop)
    start = time.perf_counter()
    m = matcher(bound, tokenizer, vocab)
    compiled = time.perf_counter() - start
    generator, ids, times = torch.Generator().manual_seed(0), [], []
    while len(ids) < 256 and (not ids or ids[-1] not in stop):   # a uniform walk over the allowed ids
        start = time.perf_counter()
        allowed = m.allowed()
        times.append(time.perf_counter() - start)
        choices = allowed.nonzero().flatten()
        ids.append(int(choices[torch.randint(len(choices), (1,), generator=generator)]))
        start = time.perf_counter()
        m.accept(ids[-1])
        times[-1] += time.perf_counter() - start
    start = time.perf_counter()
    replay_masks(bound, tokenizer, ids, vocab)
    replayed = (time.perf_counter() - start) / len(ids)
    ms = sorted(1e3 * t for t in times)
    print(f"{name}: compile {compiled:.3f} s; mask + accept per token over {len(ids)} tokens mean "
          f"{sum(ms) / len(ms):.3f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.3f}, max {ms[-1]:.3f}; "
          f"replay {1e3 * replayed:.3f} ms/token")
start = time.perf_counter()
try:
    json_schema_spec({"type": "string", "pattern": "^a{100000}$"})
except ValueError as error:   # 29 ms a token before the bound
    print(f"pattern ^a{{100000}}$: refused in {time.perf_counter() - start:.3f} s: {str(error)[:100]}...")
