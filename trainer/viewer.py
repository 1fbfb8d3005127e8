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
import json
import math
import os
import re

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
    starts, joined = [], ""
    for piece in text:
        starts.append(len(joined))
        joined += piece
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

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{padding:14px 22px;background:#1d2330;color:#fff}h1{font-size:18px;margin:0}.sub{opacity:.75;font-size:13px}
section{padding:8px 22px}h2{font-size:15px;margin:10px 0 6px}
#curves{display:grid;grid-template-columns:repeat(auto-fill,minmax(210px,1fr));gap:8px}
.chart{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:6px 8px}
.chart .t{font-size:12px;font-weight:600;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.chart svg{width:100%;height:80px;display:block}
.chart .ax{font-size:9px;fill:#667}.chart polyline{fill:none;stroke:#2f6fd6;stroke-width:1.6}
.chart circle{fill:#2f6fd6}
#controls{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:8px;position:sticky;top:0;
 background:#f6f7f9;padding:6px 0;z-index:2}
#legend{display:inline-flex;align-items:center;gap:4px;font-size:12px}#legend i{display:inline-block;width:70px;height:10px}
#count{font-size:12px;color:#667}
#layout{display:flex;gap:14px;align-items:flex-start}#rows{flex:1;min-width:0}
#record{width:330px;position:sticky;top:48px;background:#fff;border:1px solid #dde1e7;border-radius:6px;
 padding:8px 10px;font-size:12px;max-height:85vh;overflow:auto}
#record table{border-collapse:collapse;width:100%}#record td{padding:1px 4px;border-bottom:1px solid #eef0f3}
#record td:first-child{color:#667;white-space:nowrap}#record .pinned{color:#b4441c;font-weight:600}
.hint{color:#889}
.row{background:#fff;border:1px solid #dde1e7;border-radius:6px;margin-bottom:12px;padding:8px 10px}
.row .head{font-size:12px;color:#445;margin-bottom:6px;display:flex;flex-wrap:wrap;gap:6px;align-items:center}
.badge{border-radius:9px;padding:0 7px;font-size:11px;background:#e8ecf3}.badge.best{background:#cdeccd}
.badge.worst{background:#f6d2cc}.badge.seal{background:#ffe2a8}.badge.mis{background:#e4d8f6}
.toks{font:12.5px/1.9 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all}
.tok{border-radius:2px;cursor:pointer;padding:1px 0}.tok.ctx{color:#6b7280}.tok:hover,.tok.sel{outline:2px solid #1d2330}
.tok .nl::before{content:"\\21B5";color:#aab;font-size:10px}
.tok.pad{display:inline-block;width:3px;height:11px;background:#c9d3e3;margin:0 .5px;vertical-align:middle}
.fold{display:none;color:#889;font-style:italic;cursor:pointer}.row.folded .fold{display:inline}
.row.folded .prompt{display:none}
.lbl{font:600 10px system-ui,sans-serif;border-radius:3px;padding:0 4px;margin:0 3px;vertical-align:1px;
 background:#e1e5ec;color:#334}.lbl.call{background:#d5e8ff;color:#174a8c}.lbl.result{background:#dff3e4;color:#1d6b35}
.tok.in-call{text-decoration:underline #5a8fdc 2px}.tok.in-result{text-decoration:underline #3a9b58 2px}
.seal-note{display:block;margin-top:6px;padding:4px 8px;border-left:4px solid #e0a100;background:#fff6de;font-size:12px}
.cut{display:inline-block;width:0;border-left:2px dashed #e0a100;height:16px;vertical-align:middle;margin:0 2px}
.vlm{display:inline-block;vertical-align:middle;margin:2px 4px;border:2px solid #7a8fb3;border-radius:3px;max-height:120px}
.vlm.none{padding:4px 8px;font-size:11px;background:#eef1f6;color:#556}
"""

JS = r"""
const D = JSON.parse(document.getElementById("data").textContent);
const $ = id => document.getElementById(id);
const num = v => (typeof v === "number" ? v : NaN);
const short = v => Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-2) ? v.toExponential(1) : String(+v.toPrecision(3));
// every string is set as text, never parsed: a model's, a tool's or an agent's text stays data on the page
const elem = (tag, attrs = {}, ...kids) => { const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); e.append(...kids); return e; };
const fmt = (v, d = 4) => (v === null || v === undefined) ? "—" : (typeof v === "number" ?
  (Math.abs(v) > 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5) ? v.toExponential(2) : v.toFixed(d)) : String(v));

// ---- curves: one small SVG per metric, steps on the x axis
function chart(key, title) {
  const pts = D.history.filter(h => typeof h[key] === "number").map(h => [h.step, h[key]]);
  const box = document.createElement("div"); box.className = "chart";
  const last = pts.length ? fmt(pts[pts.length - 1][1], 3) : "—";
  box.append(elem("div", {class: "t", title: key}, `${title} `, elem("span", {class: "ax"}, `last ${last}`)));
  const W = 240, H = 90, L = 36, B = 14, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg"); svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (pts.length) {
    const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
    let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (x1 === x0) x1 = x0 + 1; if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const X = x => L + (x - x0) / (x1 - x0) * (W - L - 6), Y = y => 4 + (1 - (y - y0) / (y1 - y0)) * (H - B - 8);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.map(p => `${X(p[0])},${Y(p[1])}`).join(" ")); svg.appendChild(line);
    if (pts.length < 40) for (const p of pts) {
      const c = document.createElementNS(ns, "circle"); c.setAttribute("cx", X(p[0])); c.setAttribute("cy", Y(p[1]));
      c.setAttribute("r", 1.8); const tip = document.createElementNS(ns, "title");
      tip.textContent = `step ${p[0]}: ${p[1]}`; c.appendChild(tip); svg.appendChild(c);
    }
    const text = (x, y, s, anchor) => { const t = document.createElementNS(ns, "text"); t.setAttribute("x", x);
      t.setAttribute("y", y); t.setAttribute("class", "ax"); t.setAttribute("text-anchor", anchor); t.textContent = s;
      svg.appendChild(t); };
    text(L - 3, 10, short(y1), "end"); text(L - 3, H - B - 2, short(y0), "end");
    text(L, H - 2, `step ${x0}`, "start"); text(W - 6, H - 2, `${x1}`, "end");
  }
  box.appendChild(svg); $("curves").appendChild(box);
}
if (D.history.length) {
  D.curves.forEach(([k, t]) => chart(k, t));
  const shown = new Set(D.curves.map(c => c[0]));
  const keys = [...new Set(D.history.flatMap(h => Object.keys(h)))].filter(k => k !== "step" && !shown.has(k)).sort();
  $("more").append(...keys.map(k => elem("option", {value: k}, k)));
  $("more").onchange = e => { if (e.target.value) { chart(e.target.value, e.target.value); shown.add(e.target.value);
    e.target.selectedOptions[0].remove(); e.target.value = ""; } };
} else $("curves-section").style.display = "none";

// ---- colours: a diverging scale around a centre, or a category per version
const rows = D.rows;
function quantity(row, t, q) {
  if (q === "mismatch") { const p = row.trainer_logprob; return (p && row.trainable[t]) ? row.behavior_logprob[t] - p[t] : null; }
  if (q === "is_weight") { const w = row.is_weight; return (w && row.trainable[t]) ? Math.log(Math.max(num(w[t]), 1e-6)) : null; }
  if (q === "policy_version") return row.trainable[t] ? row.policy_version[t] : null;
  if (q === "trainable") return null;
  const v = row[q]; return (v && row.trainable[t]) ? num(v[t]) : null;
}
function scaleOf(q) {
  let m = 0;
  for (const r of rows) for (let t = 0; t < r.text.length; t++) { const v = quantity(r, t, q);
    if (v !== null && isFinite(v)) m = Math.max(m, Math.abs(v)); }
  return m || 1;
}
const PALETTE = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#b8a1e3", "#f7c59f", "#84dcc6", "#e9c46a"];
function colour(row, t, q, scale) {
  if (q === "trainable") {
    const why = row.mask_reason[t];
    return why === "context" ? "" : why === "trained" || why === "sampled" ? "#bfe3c0" : "#f4c7c3";
  }
  const v = quantity(row, t, q);
  if (v === null || !isFinite(v)) return "";
  if (q === "policy_version") return PALETTE[((v % PALETTE.length) + PALETTE.length) % PALETTE.length];
  const a = Math.min(Math.abs(v) / scale, 1) * 0.85 + (v !== 0 ? 0.08 : 0);
  return v >= 0 ? `rgba(38,120,220,${a})` : `rgba(220,60,40,${a})`;
}
function legend(q, scale) {
  const names = {advantage: "advantage", is_weight: "log IS weight", mismatch: "behavior − trainer",
                 loss_contribution: "loss share"};
  if (q === "trainable") return [elem("span", {style: "background:#bfe3c0"}, "\u00a0trained\u00a0"), " ",
    elem("span", {style: "background:#f4c7c3"}, "\u00a0sampled, masked or gated\u00a0"), " ",
    elem("span", {class: "tok ctx"}, "context")];
  if (q === "policy_version") return ["one colour per policy version"];
  return [`${names[q]}: ${fmt(-scale, 3)} `,
    elem("i", {style: "background:linear-gradient(90deg,rgba(220,60,40,.93),#fff,rgba(38,120,220,.93))"}), ` +${fmt(scale, 3)}`];
}

// ---- a token's record
const FIELDS = [["token_ids", "id"], ["policy_version", "policy version"], ["temperature", "temperature"],
  ["top_p", "top_p"], ["top_k", "top_k"], ["behavior_logprob", "behavior logprob"], ["trainer_logprob", "trainer logprob"],
  ["reference_logprob", "reference logprob"], ["is_weight", "IS weight"], ["mask_reason", "mask reason"],
  ["advantage", "advantage"], ["loss_contribution", "loss contribution"], ["constraint", "grammar"]];
const INTS = new Set(["token_ids", "policy_version", "top_k"]);
let pinned = null;
function showRecord(row, t, tok) {
  const cells = [["position", t], ["text", JSON.stringify(row.text[t])]];
  if (row.roles[t]) cells.push(["turn", row.roles[t]]);
  if (row.blocks[t]) cells.push(["block", row.blocks[t]]);
  for (const [k, name] of FIELDS) if (row[k]) cells.push([name, fmt(row[k][t], INTS.has(k) ? 0 : 4)]);
  if (row.trainer_logprob && row.trainable[t]) cells.push(["behavior − trainer", fmt(row.behavior_logprob[t] - row.trainer_logprob[t], 6)]);
  $("record").replaceChildren(...(pinned === tok ? [elem("div", {class: "pinned"}, "pinned (click again to release)")] : []),
    elem("div", {}, `step ${row.step ?? "—"} · rollout ${row.rollout_id} · segment ${row.segment_id}`),
    elem("table", {}, ...cells.map(([k, v]) =>
      elem("tr", {}, elem("td", {}, k), elem("td", {class: "f-" + k.replace(/\W+/g, "_")}, String(v))))));
}

// ---- rows: one card per traced row, every token an element
function card(row, index) {
  const div = document.createElement("div"); div.className = "row"; div.dataset.index = index;
  const head = document.createElement("div"); head.className = "head";
  const badge = (text, cls) => { const b = document.createElement("span"); b.className = "badge " + (cls || "");
    b.textContent = text; head.appendChild(b); };
  head.appendChild(document.createTextNode(`${row.step !== null ? "step " + row.step + " · " : ""}rollout ${row.rollout_id} · group ${row.group_id} · segment ${row.segment_id} · ${row.text.length} tokens`));
  if (row.reward !== null) badge(`reward ${fmt(row.reward, 3)}`);
  for (const b of row.badges) badge(b, b.startsWith("best") ? "best" : b.startsWith("worst") ? "worst" : "mis");
  if (row.line !== "main") badge(`${row.line} line`);
  if (row.seal_reason) badge(`sealed: ${row.seal_reason}`, "seal");
  else if (row.segment_id > 0) badge("after a seal", "seal");
  if (row.max_mismatch !== null) badge(`max |Δlp| ${fmt(row.max_mismatch, 4)}`);
  if (row.picked && row.picked !== "first rows" && row.picked !== "session") badge(`traced: ${row.picked}`);
  div.appendChild(head);
  const toks = document.createElement("div"); toks.className = "toks";
  const firstSampled = row.trainable.indexOf(true);
  let fold = null;
  if (firstSampled > 0) { fold = document.createElement("span"); fold.className = "fold";
    fold.textContent = `[${firstSampled} prompt tokens folded: click to show]`;
    fold.onclick = () => { $("hide-context").checked = false; draw(); }; toks.appendChild(fold); }
  let image = 0, prevRole = null, prevBlock = "";
  for (let t = 0; t < row.text.length; t++) {
    if (row.roles[t] !== prevRole && row.roles[t]) { const l = document.createElement("span"); l.className = "lbl";
      l.textContent = row.roles[t]; if (t < firstSampled) l.classList.add("prompt"); toks.appendChild(l); }
    if (row.blocks[t] && row.blocks[t] !== prevBlock) { const l = document.createElement("span");
      l.className = "lbl " + (row.blocks[t] === "tool call" ? "call" : "result"); l.textContent = row.blocks[t];
      if (t < firstSampled) l.classList.add("prompt"); toks.appendChild(l); }
    prevRole = row.roles[t]; prevBlock = row.blocks[t];
    const pad = row.text[t] === "<|image_pad|>";
    if (pad && (t === 0 || row.text[t - 1] !== "<|image_pad|>")) {
      const im = row.images[image++] || {};
      let node;
      if (im.png) { node = document.createElement("img"); node.className = "vlm"; node.src = "data:image/png;base64," + im.png; }
      else { node = document.createElement("span"); node.className = "vlm none"; node.textContent = "image"; }
      node.title = `image ${image}: ${im.n_tokens ?? "?"} pad tokens, grid ${JSON.stringify(im.grid_thw ?? "?")}`;
      if (t < firstSampled) node.classList.add("prompt");
      toks.appendChild(node);
    }
    if (row.common_prefix_len > 0 && t === row.common_prefix_len) { const c = document.createElement("span");
      c.className = "cut"; c.title = `the prompt that sealed this segment shares only its first ${t} tokens`; toks.appendChild(c); }
    const s = document.createElement("span");
    s.className = "tok" + (row.trainable[t] ? "" : " ctx") + (pad ? " pad" : "") +
      (row.blocks[t] === "tool call" ? " in-call" : row.blocks[t] === "tool result" ? " in-result" : "");
    if (!pad) for (const [i, part] of (row.text[t] === "" ? "\u2205" : row.text[t]).split("\n").entries()) {
      if (i) { const nl = document.createElement("span"); nl.className = "nl";   // the mark is CSS: textContent stays the token's
        s.append(nl, "\n"); }
      s.append(part);
    }
    s.dataset.t = t;
    if (t < firstSampled) s.classList.add("prompt");
    toks.appendChild(s);
  }
  toks.onmouseover = e => { const el = e.target.closest(".tok"); if (el && !pinned) showRecord(row, +el.dataset.t, el); };
  toks.onclick = e => { const el = e.target.closest(".tok"); if (!el) return;
    if (pinned) pinned.classList.remove("sel");
    pinned = pinned === el ? null : el; if (pinned) pinned.classList.add("sel"); showRecord(row, +el.dataset.t, el); };
  div.appendChild(toks);
  if (row.seal_reason) { const s = document.createElement("div"); s.className = "seal-note";
    s.textContent = `segment sealed here: ${row.seal_reason}` + (row.common_prefix_len >= 0 ?
      ` (the next prompt shared the first ${row.common_prefix_len} tokens of this one; dashed mark)` : "") +
      "; the rollout goes on in segment " + (row.segment_id + 1);
    div.appendChild(s); }
  return div;
}
const cards = rows.map(card);
const steps = [...new Set(rows.map(r => r.step))];
$("step").append(...(steps.length > 1 ? [elem("option", {value: "all"}, "all")] : []),
  ...steps.map(s => elem("option", {value: String(s)}, s === null ? "session" : String(s))));
if (steps.length > 1) $("step").value = String(steps[steps.length - 1]);

function draw() {
  const q = $("colour").value, scale = scaleOf(q), step = $("step").value, show = $("show").value, sort = $("sort").value;
  $("legend").replaceChildren(...legend(q, scale));
  let picked = rows.map((r, i) => i).filter(i => step === "all" || String(rows[i].step) === step || (rows[i].step === null));
  if (show === "sealed") picked = picked.filter(i => rows[i].sealed);
  if (show === "extremes") picked = picked.filter(i => rows[i].badges.some(b => b.endsWith("in group")));
  if (show === "mismatch") picked = picked.filter(i => rows[i].max_mismatch !== null).sort((a, b) => rows[b].max_mismatch - rows[a].max_mismatch).slice(0, 5);
  const key = i => rows[i].reward ?? -Infinity, mis = i => rows[i].max_mismatch ?? -Infinity;
  if (sort === "reward_desc") picked.sort((a, b) => key(b) - key(a));
  if (sort === "reward_asc") picked.sort((a, b) => key(a) - key(b));
  if (sort === "mismatch_desc") picked.sort((a, b) => mis(b) - mis(a));
  const box = $("rows"); box.replaceChildren(...picked.map(i => cards[i]));
  const hide = $("hide-context").checked;
  for (const i of picked) {
    const row = rows[i], el = cards[i];
    el.querySelectorAll(".tok").forEach((s, t) => { s.style.background = colour(row, t, q, scale); });
    el.classList.toggle("folded", hide);
  }
  $("count").textContent = `${picked.length} of ${rows.length} rows`;
}
for (const id of ["colour", "step", "show", "sort", "hide-context"]) $(id).onchange = draw;
if (!rows.length) $("rows").textContent = "no traced rows (train.py --train.trace_rows 0?)";
draw();
"""
