// ares-gateway trajectory viewer. Everything shown came from an agent or a model, so the DOM is built
// with createElement + textContent only (never innerHTML), links are only the ones built here, and ANSI
// escapes are stripped. The server's Content-Security-Policy allows no inline script.
"use strict";

const API = "/ui/api/";
const app = document.getElementById("app");
const crumbs = document.getElementById("crumbs");
const liveState = document.getElementById("live-state");
const tip = document.getElementById("tip");
let events = null; // the open EventSource, closed on every page change
let pageToken = 0; // bumps on navigation so late answers of an old page are dropped

// ------------------------------------------------------------------ helpers

// CSI / OSC / other ESC sequences, then any other control character except tab and newline.
const ANSI = /\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?/g;
const CONTROL = /[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]/g;
function clean(text) {
  if (text === null || text === undefined) return "";
  return String(text).replace(ANSI, "").replace(CONTROL, "\ufffd");
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  if (props) {
    for (const [k, v] of Object.entries(props)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = clean(v);
      else if (k === "title") node.title = clean(v);
      else if (k === "href") node.setAttribute("href", v); // only "#/..." built here
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) node.dataset[dk] = String(dv);
      else node.setAttribute(k, String(v));
    }
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.append(typeof c === "string" ? document.createTextNode(clean(c)) : c);
  }
  return node;
}

function cutText(obj, cls) {
  // {text, cut}: the text, and how much the server left out
  if (!obj) return null;
  const box = el("div", { class: cls || "" }, el("pre", { text: obj.text }));
  if (obj.cut) box.append(el("div", { class: "cutnote", text: `… ${obj.cut} more characters not shown` }));
  return box;
}

async function getJSON(name, params) {
  const qs = new URLSearchParams(params || {}).toString();
  const resp = await fetch(API + name + (qs ? "?" + qs : ""), { credentials: "same-origin" });
  if (resp.status === 401) { window.location.assign("/ui/login"); throw new Error("not logged in"); }
  const data = await resp.json();
  if (!resp.ok) throw new Error(data.error || resp.statusText);
  return data;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "number") {
    if (digits !== undefined) return v.toFixed(digits);
    return Number.isInteger(v) ? String(v) : v.toFixed(3);
  }
  return String(v);
}

function seconds(v) {
  if (typeof v !== "number") return "–";
  if (v < 60) return v.toFixed(1) + " s";
  return Math.floor(v / 60) + " min " + Math.round(v % 60) + " s";
}

function epHref(key, rest) { return "#/e/" + encodeURIComponent(key) + (rest || ""); }

function setCrumbs(items) {
  crumbs.replaceChildren(...items.map(([label, href]) => href ? el("a", { href, text: label }) : el("span", { text: label })));
}

function listen(params, handlers) {
  if (events) events.close();
  events = new EventSource("/ui/api/events" + (params ? "?" + new URLSearchParams(params) : ""));
  for (const [name, fn] of Object.entries(handlers)) events.addEventListener(name, (e) => fn(JSON.parse(e.data || "{}")));
  events.onopen = () => { liveState.textContent = "● following updates"; };
  events.onerror = () => { liveState.textContent = ""; };
}

function show(...nodes) { app.replaceChildren(...nodes.filter((n) => n !== null && n !== undefined && n !== false)); }

function card(label, value) {
  return el("div", { class: "card" }, el("div", { class: "label", text: label }), el("div", { class: "value", text: value }));
}

function showError(err) {
  show(el("p", { class: "error", text: "Could not load: " + err.message }), el("a", { href: "#/", text: "back to the run" }));
}

// ------------------------------------------------------------------ the run

const runState = { offset: 0, limit: 50, sort: "key", desc: false, q: "", exit: "" };
const COLUMNS = [["key", "episode"], ["task", "task"], ["attempt", "attempt"], ["reward", "reward"], ["turns", "turns"],
  ["duration", "duration"], ["exit_reason", "exit reason"], ["error", "error"], ["node", "node"]];

async function runPage() {
  const token = pageToken;
  setCrumbs([["run", null]]);
  const table = el("table", { id: "episodes" });
  const summary = el("div", { class: "cards", id: "summary" });
  const title = el("h1", { id: "run-title" });
  const info = el("p", { class: "muted", id: "run-info" });
  const search = el("input", { type: "search", placeholder: "filter: task, error, node…", id: "filter", value: runState.q });
  const exitSel = el("select", { id: "exit-filter" }, el("option", { value: "", text: "every exit reason" }));
  const pager = el("div", { class: "pager" });
  show(title, info, summary, el("div", { class: "controls" }, search, exitSel), table, pager);
  let timer = null;
  search.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => { runState.q = search.value; runState.offset = 0; load(); }, 200); });
  exitSel.addEventListener("change", () => { runState.exit = exitSel.value; runState.offset = 0; load(); });

  async function load() {
    const data = await getJSON("run", runState);
    if (token !== pageToken) return;
    title.textContent = clean(data.title);
    const run = data.run || {};
    info.textContent = clean(Object.entries(run).filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => `${k}: ${v}`).join(" · ")) +
      (data.error ? "  — error: " + clean(data.error) : "");
    const s = data.summary || {};
    const cards = [card("episodes", `${fmt(s.finished)}${s.planned ? " / " + s.planned : ""}`), card("mean reward", fmt(s.mean_reward, 3))];
    for (const [k, v] of Object.entries(s)) if (k.startsWith("pass@")) cards.push(card(k, fmt(v, 3)));
    cards.push(card("episodes/min", fmt(s.episodes_per_minute, 2)));
    if (s.running) cards.push(card("running", fmt(s.running)));
    const reasons = Object.entries(s.exit_reasons || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    cards.push(card("exit reasons", reasons || "–"));
    summary.replaceChildren(...cards);
    const have = new Set([...exitSel.options].map((o) => o.value));
    for (const r of data.exit_reasons || []) if (!have.has(r)) exitSel.append(el("option", { value: r, text: r }));
    const head = el("tr", null, ...COLUMNS.map(([k, label]) => el("th", {
      class: "col-" + k + (runState.sort === k ? " sorted" + (runState.desc ? " desc" : "") : ""), text: label, data: { sort: k },
      on: { click: () => { runState.desc = runState.sort === k ? !runState.desc : false; runState.sort = k; load(); } },
    })));
    const rows = data.rows.map((r) => el("tr", { class: r.live ? "live" : "", data: { key: r.key } },
      el("td", null, el("a", { href: epHref(r.key), text: r.key, class: "ep-link" })),
      el("td", { text: r.task }), el("td", { class: "num", text: fmt(r.attempt) }),
      el("td", { class: "num reward " + (r.reward >= 1 ? "reward-1" : r.reward === 0 ? "reward-0" : ""), text: fmt(r.reward, 3) }),
      el("td", { class: "num", text: fmt(r.turns) }), el("td", { class: "num", text: seconds(r.duration) }),
      el("td", { text: r.exit_reason }), el("td", { class: "err", text: r.error || "", title: r.error || "" }),
      el("td", { text: r.node || "" })));
    table.replaceChildren(el("thead", null, head), el("tbody", null, ...rows));
    const first = data.matched ? data.offset + 1 : 0;
    const last = data.offset + data.rows.length;
    pager.replaceChildren(
      el("button", { text: "◀ previous", disabled: data.offset <= 0, on: { click: () => { runState.offset = Math.max(0, runState.offset - runState.limit); load(); } } }),
      el("span", { id: "page-info", text: `${first}–${last} of ${data.matched}` + (data.matched !== data.total ? ` (of ${data.total})` : "") }),
      el("button", { text: "next ▶", disabled: last >= data.matched, on: { click: () => { runState.offset += runState.limit; load(); } } }));
  }
  await load();
  let pending = null;
  listen(null, { run: () => { if (!pending) pending = setTimeout(() => { pending = null; if (token === pageToken) load(); }, 150); } });
}

// ------------------------------------------------------------------ an episode

function messageBlock(m) {
  const role = m.role || "?";
  const box = el("div", { class: `msg ${role}${m.is_error ? " is-error" : ""}` },
    el("div", { class: "role", text: role + (m.tool_call_id ? ` · result of ${m.tool_call_id}` : "") + (m.name ? ` · ${m.name}` : "") + (m.is_error ? " · error" : "") }));
  if (m.reasoning) box.append(el("details", null, el("summary", { text: "reasoning" }), cutText(m.reasoning)));
  if (m.text && m.text.text) box.append(cutText(m.text, "content"));
  if (m.parts && m.parts.length) box.append(el("div", { class: "cutnote", text: "also: " + m.parts.join(", ") }));
  for (const c of m.tool_calls || []) box.append(callBlock(c));
  return box;
}

function callBlock(c) {
  return el("div", { class: "call" }, el("span", { class: "name", text: "→ " + (c.name || "?") }),
    el("span", { class: "muted", text: c.id ? "  " + c.id : "" }), cutText(c.arguments));
}

function answerBlock(a) {
  const box = el("div", { class: "msg answer" });
  if (a.error) {
    box.classList.add("is-error");
    box.append(el("div", { class: "role", text: `policy failed${a.status ? " (" + a.status + ")" : ""}` }), cutText(a.error));
    return box;
  }
  const toks = a.output_tokens !== undefined ? ` · ${a.output_tokens} output tokens` : "";
  box.append(el("div", { class: "role", text: `policy answered · ${a.finish_reason || ""}${toks}` }));
  if (a.reasoning) box.append(el("details", null, el("summary", { text: "reasoning" }), cutText(a.reasoning)));
  if (a.text && a.text.text) box.append(cutText(a.text, "content"));
  for (const c of a.tool_calls || []) box.append(callBlock(c));
  return box;
}

// A policy version as shown: none known is "none", never 0.
function versionText(v) {
  return v === null || v === undefined ? "policy version: none" : `policy version ${v}`;
}

// The distinct versions of a sample's trained responses ([start, end, version] spans), in order.
function sampleVersions(s) {
  const seen = [];
  for (const span of s.policy_versions || []) {
    const v = span[2] === null || span[2] === undefined ? "none" : String(span[2]);
    if (!seen.includes(v)) seen.push(v);
  }
  return (seen.join(", ") || "–") + (s.mixed_versions ? " (mixed)" : "");
}

// A call's usage (a turn's, or an episode's sums) as one line; fields not known are left out.
function usageText(u) {
  if (!u) return "";
  const parts = [];
  if (typeof u.prompt_tokens === "number") parts.push(`${u.prompt_tokens} prompt` +
    (typeof u.reused_prompt_tokens === "number" ? ` (${u.reused_prompt_tokens} reused)` : ""));
  if (typeof u.completion_tokens === "number") parts.push(`${u.completion_tokens} completion tokens`);
  for (const [k, label] of [["parked_seconds", "parked"], ["policy_seconds", "policy"], ["ttft_seconds", "first piece"],
    ["think_seconds", "agent thinking"]]) {
    if (typeof u[k] === "number") parts.push(`${label} ${u[k].toFixed(2)} s`);
  }
  return parts.join(" · ");
}

function turnCard(t) {
  const head = el("div", { class: "turn-head" }, el("span", { class: "n", text: `turn ${t.index}` }),
    t.side_call ? el("span", { class: "badge side", text: "side call" }) : null,
    el("span", { text: t.timestamp ? new Date(t.timestamp * 1000).toLocaleTimeString() : "" }),
    el("span", { text: typeof t.latency === "number" ? `answered in ${t.latency.toFixed(2)} s` : "" }),
    el("span", { class: "version", text: versionText(t.policy_version) }),
    el("span", { class: "usage", text: usageText(t.usage) }),
    el("span", { text: t.history !== undefined ? `${t.history} messages sent, ${t.history - t.shared} new` : "" }),
    t.diverged_at !== undefined ? el("span", { class: "badge fork", text: `history diverged at message ${t.diverged_at + 1}` }) : null);
  return el("div", { class: "turn" + (t.side_call ? " side" : ""), data: { index: t.index } }, head,
    ...t.messages.map(messageBlock), answerBlock(t.answer));
}

async function episodePage(key) {
  const token = pageToken;
  setCrumbs([["run", "#/"], [key, null]]);
  const data = await getJSON("episode", { key });
  if (token !== pageToken) return;
  const e = data.episode;
  const turnCount = el("div", { class: "value", id: "turn-count", text: fmt(data.turns) });
  const head = el("div", { class: "cards" }, card("reward", fmt(e.reward, 3)), el("div", { class: "card" }, el("div", { class: "label", text: "turns" }), turnCount),
    card("side calls", fmt(data.side_calls)), card("duration", seconds(e.duration)), card("exit reason", e.exit_reason || "–"),
    card("attempt", fmt(e.attempt)), e.node ? card("node", e.node) : null);
  const links = el("p", null,
    data.has_tree ? el("a", { href: epHref(key, "/tree"), text: "message tree", id: "tree-link" }) : el("span", { class: "muted", text: "no message tree (no turn answered with token ids, or no data dir)" }));
  const samples = el("div", { id: "samples" });
  if (data.samples.length) {
    samples.append(el("h2", { text: `Samples (${data.samples.length})` }), el("ul", null, ...data.samples.map((s) => el("li", null,
      el("a", { href: epHref(key, "/s/" + s.index), text: `sample ${s.index}`, class: "sample-link" }),
      ` ${s.side_call ? "side call · " : ""}${s.main_line ? "main line · " : ""}${s.foreign ? "foreign · " : ""}leaf ${fmt(s.branch)} · ${s.tokens} tokens · ${s.trained} trained · turns ${(s.turn_ids || []).join(", ")}`))));
  } else samples.append(el("p", { class: "muted", text: e.live ? "No training samples yet (they come from the turns answered with token ids)."
    : "No training samples (the policy gave no token ids: scripted or oracle)." }));
  const verifier = el("div", { id: "verifier" }, el("h2", { text: "Verifier" }),
    data.reward_parts && Object.keys(data.reward_parts).length ? el("p", { text: "reward parts: " + JSON.stringify(data.reward_parts) }) : null,
    data.verifier ? cutText(data.verifier) : el("p", { class: "muted", text: "no verifier output" }));
  const err = e.error ? el("p", { class: "error", id: "episode-error", text: "error: " + e.error }) : null;
  const tabs = el("div", { class: "tabs" });
  const list = el("div", { id: "turns" });
  const more = el("button", { id: "more-turns", text: "load more turns" });
  show(el("h1", { text: `${e.task} #${fmt(e.attempt)}`, id: "episode-title" }),
    el("p", { class: "muted", text: `session ${e.session_id || "–"}` + (e.live ? " · running" : "") }), head,
    e.usage ? el("p", { id: "episode-usage", text: "calls: " + (usageText(e.usage) || "no usage known") }) : null, err, links, samples, verifier,
    el("h2", { text: "Turns" }), tabs, list, more);

  const st = { line: data.side_calls ? "main" : "all", loaded: 0, total: 0, busy: false, again: false };
  function drawTabs() {
    const mk = (line, label) => el("button", { class: st.line === line ? "active" : "", text: label, data: { line },
      on: { click: () => { st.line = line; st.loaded = 0; list.replaceChildren(); drawTabs(); loadMore(); } } });
    tabs.replaceChildren(mk("main", "main line"), mk("side", "side calls"), mk("all", "all, in order"));
  }
  async function loadMore() {
    if (st.busy) { st.again = true; return; }
    st.busy = true;
    try {
      do {
        st.again = false;
        const line = st.line;
        const page = await getJSON("turns", { key, offset: st.loaded, limit: 50, line });
        if (token !== pageToken || line !== st.line) return;
        for (const t of page.turns) list.append(turnCard(t));
        st.loaded += page.turns.length;
        st.total = page.total;
        more.hidden = st.loaded >= st.total;
        more.textContent = `load more turns (${st.total - st.loaded} left)`;
        turnCount.textContent = String(page.all);
      } while (st.again);
    } finally { st.busy = false; }
  }
  more.addEventListener("click", loadMore);
  drawTabs();
  await loadMore();
  // A new turn: when every turn so far is shown, fetch the new ones at once (else the button counts them).
  listen({ key }, { turns: () => { if (token === pageToken && st.loaded >= st.total) loadMore(); } });
}

// ------------------------------------------------------------------ the message tree

async function treePage(key, side) {
  const token = pageToken;
  setCrumbs([["run", "#/"], [key, epHref(key)], ["tree", null]]);
  const data = await getJSON("tree", { key, side: side ? 1 : 0 });
  if (token !== pageToken) return;
  const toggle = el("p", null, el("a", { href: epHref(key, "/tree" + (side ? "" : "?side=1")), text: side ? "show the main line's tree" : "show the side calls' tree" }));
  if (!data.tree) { show(el("h1", { text: "Message tree" }), toggle, el("p", { class: "muted", text: data.why })); return; }
  const nodes = data.tree.nodes;
  const kids = new Map();
  const roots = [];
  for (const n of nodes) {
    if (n.parent === null || n.parent === undefined) roots.push(n);
    else { if (!kids.has(n.parent)) kids.set(n.parent, []); kids.get(n.parent).push(n); }
  }
  const forks = nodes.filter((n) => n.forks).length;
  const byLeaf = data.samples_by_leaf || {};

  function row(n) {
    const gen = n.turn !== undefined;
    const r = el("div", { class: "node" + (gen ? " generated" : ""), data: { node: n.id } },
      el("span", { class: "role", text: n.role }), el("span", { class: "text", text: n.preview, title: n.preview }));
    if (gen) r.append(el("span", { class: "badge", text: `turn ${n.turn} · ${n.output_tokens} tok` }));
    if (n.link === "replace") r.append(el("span", { class: "badge realign", text: "realigned: tokens drifted, masked", title: "its tokens were replaced by the next prompt's and masked (loss 0) on this path" }));
    if (n.link === "break") r.append(el("span", { class: "badge break", text: "drift: a new sample starts" }));
    if (n.rewrites) r.append(el("span", { class: "badge rewrite", text: `rewrite merged ×${n.rewrites.length}`, title: n.rewrites.map((w) => `turn ${w.turn_id} replayed as: ${w.replaced}`).join("\n") }));
    if (n.forks) r.append(el("span", { class: "badge fork", text: `forks ×${n.forks}` }));
    if (n.empty_turns) r.append(el("span", { class: "badge", text: `empty turns ${n.empty_turns.join(", ")}` }));
    if (n.leaf !== undefined) {
      const leaf = el("span", { class: "badge leaf", text: `leaf ${n.leaf}`, data: { leaf: n.leaf } });
      r.append(leaf);
      for (const i of byLeaf[String(n.leaf)] || []) r.append(el("a", { class: "badge leaf", href: epHref(key, "/s/" + i), text: `sample ${i}` }));
    }
    return r;
  }
  // One <ul> per branch: a chain of single children stays in it; a fork opens one nested <ul> per child.
  function branch(start) {
    const ul = el("ul");
    const stack = [[start, ul]];
    while (stack.length) {
      const [n, into] = stack.pop();
      let cur = n;
      for (;;) {
        into.append(el("li", null, row(cur)));
        const c = kids.get(cur.id) || [];
        if (c.length === 1) { cur = c[0]; continue; }
        const subs = c.map(() => el("ul"));
        subs.forEach((sub) => into.append(el("li", { class: "branch" }, sub)));
        for (let i = c.length - 1; i >= 0; i--) stack.push([c[i], subs[i]]);
        break;
      }
    }
    return ul;
  }
  const tree = el("div", { class: "tree", id: "tree" });
  for (const r of roots) tree.append(branch(r));
  show(el("h1", { text: side ? "Message tree: side calls" : "Message tree" }), toggle,
    el("p", { class: "muted", id: "tree-info", text: `${nodes.length} messages · ${data.tree.leaves} leaves · ${forks} fork point(s)` + (data.tree.truncated ? " · cut" : "") }),
    el("p", { class: "legend" }, el("span", { class: "badge fork", text: "fork" }), el("span", { class: "badge realign", text: "realigned" }),
      el("span", { class: "badge rewrite", text: "rewrite merged" }), el("span", { class: "badge leaf", text: "leaf → sample" })),
    tree);
}

// ------------------------------------------------------------------ a sample

async function samplePage(key, index, offset) {
  const token = pageToken;
  setCrumbs([["run", "#/"], [key, epHref(key)], [`sample ${index}`, null]]);
  const limit = 2000;
  const data = await getJSON("sample", { key, index, offset: offset || 0, limit });
  if (token !== pageToken) return;
  const s = data.summary;
  const low = data.low_logprob;
  const box = el("div", { class: "tokens", id: "tokens" });
  for (const [id, piece, trained, lp] of data.tokens) {
    const lowTok = trained && lp !== null && lp < low;
    // A line break is shown as ↵ before it: a token that is only "\n" would otherwise have no box to hover.
    const text = piece === null ? `[${id}]` : (piece === "" ? "∅" : piece.replace(/\r/g, "␍").replace(/\n/g, "↵\n"));
    const span = el("span", { class: "tok" + (trained ? " trained" : "") + (lowTok ? " low" : ""),
      data: { id, lp: lp === null ? "" : lp, trained } }, text);
    box.append(span);
  }
  const page = (o) => () => { window.location.hash = epHref(key, `/s/${index}`) + (o ? `@${o}` : ""); };
  const pager = el("div", { class: "pager" },
    el("button", { text: "◀ previous", disabled: data.offset <= 0, on: { click: page(Math.max(0, data.offset - limit)) } }),
    el("span", { id: "window-info", text: `tokens ${data.offset}–${data.offset + data.tokens.length} of ${data.total}` }),
    el("button", { text: "next ▶", disabled: data.offset + data.tokens.length >= data.total, on: { click: page(data.offset + limit) } }),
    el("button", { text: "jump to the response", on: { click: page(data.prompt_length) } }));
  show(el("h1", { text: `Sample ${index}` }),
    el("div", { class: "cards" }, card("tokens", fmt(data.total)), card("prompt", fmt(data.prompt_length)),
      card("response", fmt(s.response_length)), el("div", { class: "card" }, el("div", { class: "label", text: "trained tokens" }),
        el("div", { class: "value", id: "trained-count", text: String(data.trained) })), card("reward", fmt(s.reward, 3)),
      card("leaf", fmt(s.branch)), card("turns", (s.turn_ids || []).join(", ") || "–"), card("trained turns", (s.trained_turn_ids || []).join(", ") || "–"),
      card("policy versions", sampleVersions(s))),
    el("p", { class: "legend" }, el("span", { class: "tok trained", text: "trained (loss mask 1)" }), el("span", { class: "tok", text: "not trained" }),
      el("span", { class: "tok trained low", text: `low probability (p < ${Math.exp(low).toFixed(2)})` }),
      el("span", { class: "muted", text: data.pieces ? "hover a token for its id and logprob" : "no tokenizer: tokens shown as [id]; hover for the logprob" })),
    pager, box);
}

// Hovering a token shows its id and logprob (one listener for every token).
document.addEventListener("mouseover", (ev) => {
  const t = ev.target;
  if (!(t instanceof HTMLElement) || !t.classList.contains("tok") || t.dataset.id === undefined) { tip.hidden = true; return; }
  const lp = t.dataset.lp;
  tip.textContent = `id ${t.dataset.id}` + (lp !== "" ? ` · logprob ${Number(lp).toFixed(4)} · p ${Math.exp(Number(lp)).toFixed(4)}` : " · not trained (no logprob)");
  const r = t.getBoundingClientRect();
  tip.style.left = Math.min(r.left, window.innerWidth - 320) + "px";
  tip.style.top = (r.bottom + 4) + "px";
  tip.hidden = false;
});

// ------------------------------------------------------------------ routing

async function route() {
  pageToken += 1;
  if (events) { events.close(); events = null; liveState.textContent = ""; }
  tip.hidden = true;
  const hash = window.location.hash.replace(/^#/, "") || "/";
  const parts = hash.split("/"); // "", "e", key, ...
  try {
    if (parts[1] === "e" && parts[2] !== undefined) {
      const key = decodeURIComponent(parts[2]);
      if (parts[3] && parts[3].startsWith("tree")) return await treePage(key, parts[3].includes("side=1"));
      if (parts[3] === "s" && parts[4] !== undefined) {
        const [idx, off] = parts[4].split("@");
        return await samplePage(key, Number(idx), Number(off || 0));
      }
      return await episodePage(key);
    }
    return await runPage();
  } catch (err) { showError(err); }
}

if (/^#token=/.test(window.location.hash)) {
  // view's printed URL, opened by a browser that has a cookie already: log in again with the token
  // (it may be another view's cookie); the login page takes the token out of the history.
  window.location.replace("/ui/login" + window.location.hash);
} else {
  window.addEventListener("hashchange", route);
  route();
}
