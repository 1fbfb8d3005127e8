# trainer/viewer.py — see a run: one self-contained HTML page of its metric curves and every token of its traced rows.
#
# Owns: reading what a run left (OUT/metrics.jsonl, OUT/traces/step_N.jsonl, OUT/config.json) or what a loopback
# session holds (session.session_trace) into one page model of plain JSON rows, finding the rows worth reading
# (best and worst reward of a traced group, largest behavior - trainer mismatch, sealed rollouts), labelling what
# the chat template wrote (turns, tool calls, tool results, a VLM's image pads), and rendering it all as one HTML
# file: inline CSS, inline JS, inline SVG, the data as JSON inside it. It opens from disk with no network.
#
# `python train.py view OUT` writes OUT/view.html; a loopback session's page is GET /s/<id>/view (loopback.py).
# On the page every token is one element (`span.tok`, in row order: a row of n tokens has n of them, image pads
# included); its colour is the quantity picked at the top (advantage, IS weight, behavior - trainer logprob,
# policy version, loss share, trainable or context); hovering shows its whole record, a click pins it.
# Never: recomputes anything the trainer computed (the page shows the trace's numbers as written), fetches
# anything (no CDN, no fonts, no images from elsewhere), writes outside the page it is asked for, or lets a string
# a model, a tool, an agent or a request wrote become markup: the embedded JSON holds no `<`, `>` or `&` (no text
# can close its script block or put the parser in its escaped-script state), and the script sets every string as
# text (createElement, textContent, attributes), never through innerHTML.
from __future__ import annotations

import html
import itertools
import json
import math
import os
import re
from pathlib import Path

# the curves drawn first, in this order, where the run logged them (any other metric can be added on the page)
CURVES = [("rollout/reward", "reward"), ("rollout/accuracy", "accuracy"), ("eval/pass@1", "held-out pass@1"),
          ("rollout/response_length", "response length (tokens)"),
          ("mismatch/logprob_diff_mean", "|behavior - trainer| logprob"), ("mismatch/k3_kl", "k3 KL behavior || trainer"),
          ("actor/loss", "loss"), ("actor/grad_norm", "grad norm"), ("actor/entropy", "entropy"),
          ("perf/tokens_per_s", "sampled tokens / s"), ("actor/staleness_mean", "staleness (versions)"),
          ("rollout/seals_per_rollout", "seals per rollout"), ("is/is_masked_frac", "IS masked fraction")]

# what the chat template writes, found in a row's text: a turn's opening (ChatML, as every recipe's template
# renders it) and the Hermes/Qwen tool blocks (data.py's template; agents/tools.py's TOOL_RESPONSE)
TURN_OPEN = re.compile(r"<\|im_start\|>(\w+)")
BLOCKS = [(re.compile(r"<tool_call>.*?(</tool_call>|$)", re.S), "tool call"),
          (re.compile(r"<tool_response>.*?(</tool_response>|$)", re.S), "tool result")]
IMAGE_PAD = "<|image_pad|>"


# ---- rows: a run's traces and a loopback session's segments, in one shape ------------------------------------

def label_tokens(text: list[str]) -> tuple[list[str], list[str]]:
    """Per token: the role of the turn it is in ("" before any turn opens) and the tool block it is part of
    ("tool call", "tool result" or ""), found in the row's text as the template wrote it."""
    starts, joined = list(itertools.accumulate(map(len, text), initial=0))[:-1], "".join(text)
    roles, blocks = [""] * len(text), [""] * len(text)
    char_role = [""] * (len(joined) + 1)
    opens = list(TURN_OPEN.finditer(joined))
    for i, match in enumerate(opens):
        end = opens[i + 1].start() if i + 1 < len(opens) else len(joined)
        char_role[match.start():end] = [match.group(1)] * (end - match.start())
    char_block = [""] * (len(joined) + 1)
    for pattern, name in BLOCKS:
        for match in pattern.finditer(joined):
            char_block[match.start():match.end()] = [name] * (match.end() - match.start())
    for t, s in enumerate(starts):
        roles[t], blocks[t] = char_role[s], char_block[s]
        # a call is the model's (an assistant turn), a result the template's reply to it (any other turn): a system
        # prompt's example of the format is neither
        if (blocks[t] == "tool call" and roles[t] != "assistant"
                or blocks[t] == "tool result" and roles[t] in ("assistant", "system", "")):
            blocks[t] = ""
    return roles, blocks


def trace_row(record: dict) -> dict:
    """One line of OUT/traces/step_N.jsonl as a page row (the trace's numbers, unchanged)."""
    row = dict(record)
    row["trainable"] = [why != "context" for why in record["mask_reason"]]
    row.setdefault("images", [])
    row.setdefault("reward", None)
    row.setdefault("line", "main")
    return row


def session_rows(trace: dict) -> list[dict]:
    """A loopback session's trace (session.session_trace) as page rows, one per segment: what the trainer will
    see before anything is trained (no trainer logprob, IS weight, advantage or loss yet)."""
    samplings = trace["samplings"]
    rows = []
    for seg in trace["segments"]:
        drawn = [samplings[i] for i in seg["sampling"]]
        rows.append({"step": None, "rollout_id": trace["rollout_id"], "group_id": trace["group_id"],
                     "line": seg["line"], "segment_id": seg["segment_id"], "seal_reason": seg["seal_reason"],
                     "common_prefix_len": seg["common_prefix_len"], "reward": None, "picked": "session",
                     "token_ids": seg["token_ids"], "text": seg["tokens"], "trainable": seg["trainable"],
                     "policy_version": seg["policy_versions"], "behavior_logprob": seg["behavior_logprobs"],
                     "temperature": [s["temperature"] for s in drawn], "top_p": [s["top_p"] for s in drawn],
                     "top_k": [s["top_k"] for s in drawn],
                     "constraint": [s["constraint"] for s in drawn],
                     "mask_reason": ["sampled" if t else "context" for t in seg["trainable"]],
                     "images": [{**image, "png": ""} for image in seg["images"]]})
    return rows


def annotate(rows: list[dict]) -> list[dict]:
    """What makes a row worth reading, as badges the page filters and sorts on: the best and worst reward of its
    traced group (when they differ), its largest |behavior - trainer| logprob on a sampled token, its seal."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        row["roles"], row["blocks"] = label_tokens(row["text"])
        trainer = row.get("trainer_logprob")
        gaps = [abs(b - p) for b, p, t in zip(row["behavior_logprob"], trainer or [], row["trainable"]) if t]
        row["max_mismatch"] = max(gaps) if gaps else None
        row["sealed"] = bool(row["seal_reason"]) or row["segment_id"] > 0
        row["badges"] = []
        if row["reward"] is not None:
            groups.setdefault((row["step"], row["group_id"]), []).append(row)
    for members in groups.values():
        rewards = [r["reward"] for r in members]
        if len(members) > 1 and max(rewards) > min(rewards):
            for r in members:
                r["badges"] += (["best in group"] if r["reward"] == max(rewards) else []) + \
                               (["worst in group"] if r["reward"] == min(rewards) else [])
    ranked = sorted((r for r in rows if r["max_mismatch"] is not None), key=lambda r: -r["max_mismatch"])
    if ranked and ranked[0]["max_mismatch"] > 0:
        ranked[0]["badges"].append("largest mismatch")
    return rows


# ---- what a run left --------------------------------------------------------------------------------------------

def load_run(out: str) -> dict:
    """A run folder -> the page model: its config, its metric history and every traced row, in step order."""
    if not os.path.isdir(out):
        raise SystemExit(f"error: no run folder at {out!r}; give the --out folder of a train.py run")
    history = []
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            history = [json.loads(line) for line in f if line.strip()]
    config = {}
    if os.path.exists(os.path.join(out, "config.json")):
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
    folder, rows = os.path.join(out, "traces"), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            rows += [trace_row(json.loads(line)) for line in f if line.strip()]
    if not history and not rows:
        raise SystemExit(f"error: {out!r} holds neither metrics.jsonl nor traces/; is it a train.py run folder?")
    run = config.get("run", {})
    title = f"{run.get('recipe', '?')} run {os.path.basename(os.path.abspath(out))}"
    subtitle = ", ".join(f"{k} {v}" for k, v in [("model", run.get("model")), ("steps", run.get("steps")),
                                                  ("seed", run.get("seed"))] if v is not None)
    return {"title": title, "subtitle": subtitle, "history": history, "rows": annotate(rows),
            "curves": [[k, t] for k, t in CURVES if any(k in h for h in history)]}


def session_page(trace: dict) -> dict:
    """A loopback session's trace -> the page model (no metrics: nothing has been trained)."""
    return {"title": f"loopback session — rollout {trace['rollout_id']}",
            "subtitle": f"{len(trace['segments'])} segment(s), before training: behavior logprobs and versions only",
            "history": [], "curves": [], "rows": annotate(session_rows(trace))}


def write_run_page(out: str, path: str = "") -> str:
    """`python train.py view OUT`: OUT/view.html (or `path`); returns where it went."""
    path = path or os.path.join(out, "view.html")
    page = render(load_run(out))
    with open(path, "w") as f:
        f.write(page)
    return path


# ---- the page ------------------------------------------------------------------------------------------------

def _finite(value):
    """JSON has no NaN or infinity: they travel as strings the page prints as they are."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


# what HTML reads inside a script block, as JSON's own escapes: `</script>` would end it, `<!--` then `<script`
# would leave it open to the end of the document (a dead page). json.dumps' ASCII output already writes U+2028,
# U+2029 and every other non-ASCII character as \u escapes.
JSON_IN_HTML = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def render(page: dict) -> str:
    """The page model -> one HTML document. The data sits in a JSON script element holding none of `<`, `>`, `&`;
    the script draws curves and rows from it. The placeholders are filled in one pass, so a title that reads
    `%DATA%` stays that text."""
    parts = {"TITLE": html.escape(page["title"]), "SUBTITLE": html.escape(page["subtitle"]), "CSS": CSS, "JS": JS,
             "DATA": json.dumps(_finite(page), allow_nan=False).translate(JSON_IN_HTML)}
    return re.sub(r"%(TITLE|SUBTITLE|CSS|JS|DATA)%", lambda m: parts[m.group(1)], PAGE)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>%TITLE%</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>%CSS%</style></head>
<body><header><h1>%TITLE%</h1><div class="sub">%SUBTITLE%</div></header>
<section id="curves-section"><h2>Metrics</h2><div id="curves"></div>
<label>add a curve <select id="more"><option value="">—</option></select></label></section>
<section><h2>Traced rows</h2>
<div id="controls">
 <label>step <select id="step"></select></label>
 <label>colour by <select id="colour">
  <option value="advantage">advantage</option><option value="is_weight">IS weight</option>
  <option value="mismatch">behavior − trainer logprob</option><option value="policy_version">policy version</option>
  <option value="loss_contribution">loss share</option><option value="trainable">trainable vs context</option>
 </select></label>
 <label>show <select id="show"><option value="all">all rows</option><option value="sealed">sealed rollouts</option>
  <option value="extremes">best and worst of each group</option><option value="mismatch">largest mismatch</option>
 </select></label>
 <label>sort <select id="sort"><option value="trace">trace order</option><option value="reward_desc">reward, highest first</option>
  <option value="reward_asc">reward, lowest first</option><option value="mismatch_desc">mismatch, largest first</option>
 </select></label>
 <label><input type="checkbox" id="hide-context"> fold the prompt</label>
 <span id="legend"></span><span id="count"></span>
</div>
<div id="layout"><div id="rows"></div><aside id="record"><div class="hint">hover a token to see its record;
click to pin it</div></aside></div></section>
<script type="application/json" id="data">%DATA%</script>
<script>%JS%</script></body></html>
"""

# the page's style and script, inlined into it (the page fetches nothing)
CSS = (Path(__file__).parent / "viewer.css").read_text()
JS = (Path(__file__).parent / "viewer.js").read_text()
