// trainer/viewer.js: the run page's script; trainer/viewer.py inlines it into the page, after the data
// it draws (a JSON script element). Every string is set as text (createElement, textContent, attributes), never
// parsed as markup.
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
