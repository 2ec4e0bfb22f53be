// ember dashboard: polls who serves the page, the run list and each ticked run's new metric rows
// every 2 s, and draws every scalar as a grid of small charts (train_X, eval_train_X and val_X on one
// chart X), every ticked run on each. State for tests and curious users: window.ember.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const POLL_MS = 2000;
// Key prefixes that put a metric on a shared chart: `train_loss`, `eval_train_loss` and `val_loss`
// are all drawn on `loss`, told apart by their line.
const ROLES = [["eval_train_", "eval_train"], ["train_", "train"], ["val_", "val"]];
const ROLE_ORDER = { "": 0, train: 1, eval_train: 2, val: 3 };
const DASH = { "": undefined, train: undefined, eval_train: [2, 3], val: [6, 4] };
// Columns that are x axes, never charts of their own.
const X_KEYS = new Set(["step", "elapsed_s"]);
// A run whose metrics changed this recently counts as live (under `ember dashboard`).
const LIVE_S = 10;

const state = {
  runs: new Map(), // name -> { summary, cols: {key: [values]}, rows, color, selected, samples, hparams, hparamsVersion }
  x: "step",
  smoothing: 0,
  log: false,
  filter: "",
  charts: new Map(), // chart name -> { card, plotEl, plot, layout, zoomed, ... }
  enlarged: null, // the name of the enlarged chart
  server: null, // the last answer of /api/server
  serverUp: false,
  polls: 0,
};
window.ember = state;

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

// The server did not answer at all (it exited, or the network is down): not an error of the page.
class Gone extends Error {}

async function getJson(url) {
  let r;
  try {
    r = await fetch(url, { cache: "no-store" });
  } catch (e) {
    throw new Gone(e.message);
  }
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  try {
    return await r.json();
  } catch (e) {
    if (e instanceof SyntaxError) throw e;
    throw new Gone(e.message);
  }
}

function appendColumns(run, cols) {
  const n = cols.rows;
  for (const [k, v] of Object.entries(cols.columns)) {
    if (!run.cols[k]) run.cols[k] = new Array(run.rows).fill(null);
    const col = run.cols[k];
    for (const x of v) col.push(x); // not push(...v): a long run's first load overflows the argument list
  }
  run.rows += n;
  for (const k of Object.keys(run.cols)) {
    while (run.cols[k].length < run.rows) run.cols[k].push(null);
  }
  return n;
}

// One refresh at a time: a second caller (a ticked box during a poll) waits for the one in flight,
// so two never ask for rows from the same `since` and append them twice.
let refreshing = Promise.resolve();
function refreshRuns() {
  const next = refreshing.then(refreshOnce, refreshOnce);
  refreshing = next.catch(() => {});
  return next;
}

async function refreshOnce() {
  // Who serves the page first: a trainer that has ended waits (a few seconds) until a page has
  // fetched everything once more, and this poll is that page's last fetch of its metrics.
  const server = await getJson("/api/server");
  state.server = server;
  state.serverUp = true;
  const summaries = await getJson("/api/runs");
  let changed = false;
  summaries.forEach((s) => {
    let run = state.runs.get(s.name);
    if (!run) {
      const selected = state.runs.size < 8;
      run = { summary: s, cols: {}, rows: 0, color: COLORS[state.runs.size % COLORS.length], selected, samples: [], hparams: null, hparamsVersion: -1 };
      state.runs.set(s.name, run);
      changed = true;
    }
    if (s.rows < run.rows) { // the file was rewritten (a resumed run): read it again
      run.cols = {};
      run.rows = 0;
    }
    run.summary = s;
  });
  for (const [name, run] of state.runs) {
    if (!run.selected || run.summary.rows === run.rows) continue;
    const cols = await getJson(`/api/metrics?run=${encodeURIComponent(name)}&since=${run.rows}`);
    if (appendColumns(run, cols) > 0) changed = true;
  }
  for (const [name, run] of state.runs) {
    if (!run.selected) continue;
    if (run.summary.samples !== run.samples.length) {
      run.samples = await getJson(`/api/samples?run=${encodeURIComponent(name)}`);
    }
    if (run.summary.config_version !== run.hparamsVersion) {
      const pairs = await getJson(`/api/hparams?run=${encodeURIComponent(name)}`);
      run.hparams = Object.fromEntries(pairs);
      run.hparamsVersion = run.summary.config_version;
    }
  }
  if (server.trainer_ended) {
    await getJson("/api/server?fetched=1");
    state.finalFetched = true;
  }
  $("logdir-status").textContent = `${state.runs.size} run${state.runs.size === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`;
  renderRunList();
  if (changed || state.charts.size === 0) renderGrid();
  renderLegend();
  renderHparams();
  renderSamples();
  state.polls += 1;
  document.body.dataset.polls = state.polls;
}

// --- Who serves the page. ---

function shellWord(s) {
  return /^[\w./:@%+=,-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
}

function renderServer() {
  const box = $("server");
  const s = state.server;
  const parts = [];
  let mode;
  if (!s) {
    mode = "gone";
    parts.push("no dashboard answers at this address; the page retries every few seconds");
  } else if (s.served_by === "trainer") {
    const keep = `ember dashboard --logdir ${shellWord(s.logdir)}`;
    if (state.serverUp && !s.trainer_ended) {
      mode = "trainer";
      parts.push(`served by the trainer of run ${s.run} (pid ${s.pid}); when training ends the page keeps what it has`);
    } else {
      mode = "trainer-exited";
      parts.push(`served by the trainer of run ${s.run} — it has exited; `, { code: keep }, " keeps browsing");
    }
  } else if (state.serverUp) {
    mode = "dashboard";
    parts.push(`served by ember dashboard (pid ${s.pid}) over ${s.logdir}`);
  } else {
    mode = "gone";
    parts.push(`ember dashboard (pid ${s.pid}) stopped answering; the page keeps what it has and reconnects when a dashboard serves this address again`);
  }
  const key = JSON.stringify([mode, parts]);
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.textContent = "";
  for (const p of parts) box.append(typeof p === "string" ? document.createTextNode(p) : el("code", null, p.code));
  box.className = mode === "trainer-exited" ? "ended" : mode === "gone" ? "gone" : "muted";
  document.body.dataset.server = mode;
}

function serverGone() {
  if (!state.serverUp && document.body.dataset.server) return;
  state.serverUp = false;
  renderRunList();
  renderHparams();
}

// --- The run list. ---

// finished: the last step is the config's max_steps; live: being written (its trainer serves the
// page and has not ended, or its metrics changed in the last seconds); ended: its trainer served
// the page and has exited before max_steps; quiet: none of these.
function runState(name, run) {
  const s = run.summary;
  if (s.finished) return "finished";
  const srv = state.server;
  if (srv && srv.served_by === "trainer" && srv.run === name) return state.serverUp && !srv.trainer_ended ? "live" : "ended";
  if (state.serverUp && s.updated_s < LIVE_S) return "live";
  return "quiet";
}

function meta(name, run) {
  const s = run.summary;
  const step = s.last_step === null || s.last_step === undefined ? "–" : s.last_step;
  const of = s.max_steps === null || s.max_steps === undefined ? "" : `/${s.max_steps}`;
  const st = runState(name, run);
  return `step ${step}${of}${st === "quiet" ? "" : ` · ${st}`}`;
}

function renderRunList() {
  const ul = $("runs");
  const names = [...state.runs.keys()];
  if (ul.dataset.names !== names.join("\n") || ul.children.length !== names.length) {
    ul.dataset.names = names.join("\n");
    ul.innerHTML = "";
    for (const name of names) {
      const run = state.runs.get(name);
      const li = el("li");
      li.dataset.run = name;
      const box = el("input");
      box.type = "checkbox";
      box.checked = run.selected;
      box.onchange = () => {
        run.selected = box.checked;
        refreshRuns().then(renderGrid, () => renderGrid());
      };
      const swatch = el("span", "swatch");
      swatch.style.background = run.color;
      const label = el("span", "name", name);
      label.onclick = () => showConfig(name);
      li.append(box, swatch, label, el("span", "meta muted"));
      ul.append(li);
    }
  }
  names.forEach((name, i) => {
    const run = state.runs.get(name);
    const li = ul.children[i];
    li.dataset.state = runState(name, run);
    li.querySelector(".meta").textContent = meta(name, run);
  });
}

async function showConfig(name) {
  $("config-run").textContent = name;
  try {
    const text = await getJson(`/api/config?run=${encodeURIComponent(name)}`);
    $("config").textContent = text || "(no config.toml)";
  } catch (e) {
    $("config").textContent = e instanceof Gone ? "(the server is gone; the config is not kept)" : e.message;
  }
}

// --- The grid of charts. ---

// Every scalar of the ticked runs, grouped into charts: [{name, members: [{key, role}]}], `loss`
// first, then by name; those matching the filter.
function chartGroups() {
  const keys = new Set();
  for (const run of state.runs.values()) {
    if (!run.selected) continue;
    for (const k of Object.keys(run.cols)) if (!X_KEYS.has(k)) keys.add(k);
  }
  const byChart = new Map();
  for (const key of keys) {
    let chart = key;
    let role = "";
    for (const [prefix, r] of ROLES) {
      if (key.startsWith(prefix) && key.length > prefix.length) {
        chart = key.slice(prefix.length);
        role = r;
        break;
      }
    }
    if (!byChart.has(chart)) byChart.set(chart, []);
    byChart.get(chart).push({ key, role });
  }
  const groups = [];
  for (const [chart, members] of byChart) {
    if (members.length === 1) groups.push({ name: members[0].key, members: [{ key: members[0].key, role: "" }] });
    else groups.push({ name: chart, members: members.sort((a, b) => ROLE_ORDER[a.role] - ROLE_ORDER[b.role]) });
  }
  groups.sort((a, b) => (a.name === "loss" ? -1 : b.name === "loss" ? 1 : a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  const f = state.filter.trim().toLowerCase();
  return f ? groups.filter((g) => g.name.toLowerCase().includes(f) || g.members.some((m) => m.key.toLowerCase().includes(f))) : groups;
}

// Exponential moving average that skips missing points, debiased as TensorBoard's smoothing is.
function smooth(values, alpha) {
  if (alpha <= 0) return values;
  let last = 0, weight = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return null;
    last = last * alpha + (1 - alpha) * v;
    weight = weight * alpha + (1 - alpha);
    return last / weight;
  });
}

// One series per ticked run and member key it has: its points against the chosen x.
function chartSeries(group) {
  const out = [];
  for (const [name, run] of state.runs) {
    if (!run.selected) continue;
    const xs = run.cols[state.x] || [];
    for (const m of group.members) {
      const col = run.cols[m.key];
      if (!col) continue;
      const ys = smooth(col, state.smoothing);
      const px = [], py = [];
      for (let i = 0; i < xs.length; i++) {
        const y = ys[i];
        if (xs[i] === null || y === null || y === undefined || !Number.isFinite(y) || (state.log && y <= 0)) continue;
        px.push(xs[i]);
        py.push(y);
      }
      if (!px.length) continue;
      const label = group.members.length > 1 ? `${name} ${m.role}` : name;
      out.push({ label, run, role: m.role, table: [px, py] });
    }
  }
  return out;
}

// Axis numbers short enough for a small chart: 17539183 -> 17.5M.
function compact(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a >= 1e9) return `${+(v / 1e9).toPrecision(3)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toPrecision(3)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toPrecision(3)}k`;
  if (a === 0) return "0";
  if (a < 1e-3) return v.toExponential(1);
  return String(+v.toPrecision(4));
}

function makeCard(name) {
  const card = el("div", "card");
  card.dataset.chart = name;
  const head = el("div", "card-head");
  head.title = "enlarge / back to the grid";
  const keys = el("span", "keys muted");
  const button = el("button", null, "⤢");
  head.append(el("span", "title", name), keys, button);
  head.onclick = () => toggleEnlarged(name);
  const plotEl = el("div", "plot");
  card.append(head, plotEl);
  return { card, keys, button, plotEl, plot: null, layout: "", zoomed: false };
}

function toggleEnlarged(name) {
  state.enlarged = state.enlarged === name ? null : name;
  renderGrid();
  const c = state.charts.get(name);
  if (c) c.card.scrollIntoView({ block: "nearest" });
}

function drawCard(c, group) {
  const big = state.enlarged === group.name;
  c.card.classList.toggle("enlarged", big);
  c.button.textContent = big ? "back to the grid" : "⤢";
  c.keys.textContent = group.members.length > 1 ? group.members.map((m) => m.key).join(" · ") : "";
  const series = chartSeries(group);
  const width = Math.max(260, Math.floor(c.plotEl.clientWidth || 330));
  const height = big ? 440 : 190;
  const layout = JSON.stringify([state.x, state.log, big, width, series.map((s) => s.label)]);
  const data = series.length ? uPlot.join(series.map((s) => s.table)) : [[]];
  if (c.plot && c.layout === layout) {
    c.plot.setData(data, !c.zoomed);
  } else {
    if (c.plot) c.plot.destroy();
    c.zoomed = false;
    const xLabel = state.x === "step" ? "step" : "wall time (s)";
    const opts = {
      width,
      height,
      legend: { show: big },
      scales: { x: { time: false }, y: state.log ? { distr: 3 } : {} },
      axes: [
        { label: big ? xLabel : undefined, values: (u, splits) => splits.map(compact) },
        { label: big ? group.name : undefined, size: 52, values: (u, splits) => splits.map(compact) },
      ],
      series: [{ label: state.x }].concat(series.map((s) => ({
        label: s.label,
        stroke: s.run.color,
        width: s.role === "val" ? 2 : 1.5,
        dash: DASH[s.role],
        spanGaps: true,
        points: s.role === "val" ? { show: true, size: 6, fill: s.run.color } : {},
      }))),
      cursor: { drag: { x: true, y: false }, sync: { key: "ember" } },
      hooks: {
        setSelect: [() => { c.zoomed = true; }],
        ready: [(u) => u.over.addEventListener("dblclick", () => { c.zoomed = false; })],
      },
    };
    c.plot = new uPlot(opts, data, c.plotEl);
    c.layout = layout;
  }
  c.card.dataset.keys = group.members.map((m) => m.key).join(",");
  c.card.dataset.series = String(series.length);
  c.card.dataset.points = JSON.stringify(Object.fromEntries(series.map((s) => [s.label, s.table[0].length])));
}

function renderGrid() {
  const grid = $("grid");
  const groups = chartGroups();
  const seen = new Set();
  groups.forEach((g, i) => {
    seen.add(g.name);
    let c = state.charts.get(g.name);
    if (!c) {
      c = makeCard(g.name);
      state.charts.set(g.name, c);
    }
    if (grid.children[i] !== c.card) grid.insertBefore(c.card, grid.children[i] || null);
  });
  for (const [name, c] of state.charts) {
    if (seen.has(name)) continue;
    if (c.plot) c.plot.destroy();
    c.card.remove();
    state.charts.delete(name);
  }
  if (state.enlarged && !seen.has(state.enlarged)) state.enlarged = null;
  // Every card in place first, so that each one measures its final width.
  for (const g of groups) state.charts.get(g.name).card.classList.toggle("enlarged", state.enlarged === g.name);
  for (const g of groups) drawCard(state.charts.get(g.name), g);
  grid.dataset.charts = groups.map((g) => g.name).join(",");
  grid.dataset.enlarged = state.enlarged || "";
}

// The runs' colours, and the line of each kind of series where a chart holds several.
function renderLegend() {
  const box = $("legend");
  const shown = [...state.runs].filter(([, r]) => r.selected);
  const roles = new Set();
  for (const g of chartGroups()) if (g.members.length > 1) g.members.forEach((m) => roles.add(m.role));
  const key = JSON.stringify([shown.map(([n, r]) => [n, r.color]), [...roles]]);
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.textContent = "";
  for (const [name, run] of shown) {
    const item = el("span");
    const sw = el("span", "swatch");
    sw.style.background = run.color;
    item.append(sw, document.createTextNode(name));
    box.append(item);
  }
  for (const role of ["train", "eval_train", "val"]) {
    if (!roles.has(role)) continue;
    const item = el("span");
    item.dataset.role = role;
    const dash = DASH[role] ? DASH[role].join(" ") : "none";
    const dot = role === "val" ? '<circle cx="14" cy="5" r="3" fill="#555"/>' : "";
    item.innerHTML = `<svg width="28" height="10"><line x1="0" y1="5" x2="28" y2="5" stroke="#555" stroke-width="2" stroke-dasharray="${dash}"/>${dot}</svg>`;
    item.append(document.createTextNode(role));
    box.append(item);
  }
}

// --- The ticked runs' configs side by side. ---

// The lowest val_loss of a run after a training step and its step, or null: the trainer's best/
// (step 0's evaluation, of the starting weights, is never a candidate).
function bestVal(run) {
  const vals = run.cols.val_loss || [];
  const steps = run.cols.step || [];
  let best = null;
  vals.forEach((v, i) => {
    if (steps[i] > 0 && v !== null && Number.isFinite(v) && (best === null || v < best.loss)) best = { loss: v, step: steps[i] };
  });
  return best;
}

function shown(v) {
  if (v === undefined) return "–";
  return typeof v === "string" ? v : JSON.stringify(v);
}

function renderHparams() {
  const runs = [...state.runs].filter(([, r]) => r.selected);
  const withConfig = runs.filter(([, r]) => r.hparams);
  const all = $("hparams-all").checked;
  const keys = new Set();
  for (const [, r] of withConfig) Object.keys(r.hparams).forEach((k) => keys.add(k));
  let cols = [...keys].sort();
  if (!all) {
    cols = withConfig.length < 2 ? [] : cols.filter((k) => new Set(withConfig.map(([, r]) => JSON.stringify(r.hparams[k]))).size > 1);
  }
  const rows = runs.map(([name, run]) => ({ name, run, best: bestVal(run), state: runState(name, run) }));
  const lowest = rows.reduce((m, r) => (r.best && (m === null || r.best.loss < m) ? r.best.loss : m), null);
  let note = "";
  if (!all && runs.length < 2) note = "tick two or more runs to see the config keys that differ, or show all keys";
  else if (!all && withConfig.length >= 2 && cols.length === 0) note = "the ticked runs' configs are the same";
  else if (!all) note = cols.length === 1 ? "1 config key differs" : `${cols.length} config keys differ`;
  const key = JSON.stringify([cols, note, rows.map((r) => [r.name, r.best, r.state, r.run.summary.last_step, cols.map((k) => r.run.hparams && r.run.hparams[k])])]);
  const table = $("hparams");
  if (table.dataset.key === key) return;
  table.dataset.key = key;
  $("hparams-note").textContent = note;
  table.textContent = "";
  const head = el("tr");
  for (const h of ["run", "state", "step", "best val_loss", "at step"].concat(cols)) head.append(el("th", null, h));
  const thead = el("thead");
  thead.append(head);
  const tbody = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    tr.dataset.run = r.name;
    if (r.best && r.best.loss === lowest && rows.length > 1) tr.className = "best";
    const name = el("td");
    const sw = el("span", "swatch");
    sw.style.background = r.run.color;
    name.append(sw, document.createTextNode(` ${r.name}`));
    tr.append(name, el("td", null, r.state === "quiet" ? "" : r.state), el("td", "num", shown(r.run.summary.last_step ?? undefined)));
    const best = el("td", "num best-val", r.best ? r.best.loss.toFixed(4) : "–");
    best.dataset.key = "best_val_loss";
    const at = el("td", "num", r.best ? shown(r.best.step) : "–");
    at.dataset.key = "best_val_step";
    tr.append(best, at);
    for (const k of cols) {
      const td = el("td", null, r.run.hparams ? shown(r.run.hparams[k]) : "…");
      td.dataset.key = k;
      tr.append(td);
    }
    tbody.append(tr);
  }
  table.append(thead, tbody);
}

// --- Samples. ---

function renderSamples() {
  const box = $("samples");
  const parts = [];
  for (const [name, run] of state.runs) {
    if (!run.selected || !run.samples.length) continue;
    for (const s of run.samples.slice(-2).reverse()) parts.push({ name, s });
  }
  const key = parts.map((p) => `${p.name}:${p.s.step}`).join(",");
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.innerHTML = "";
  box.className = parts.length ? "" : "muted";
  if (!parts.length) box.textContent = "samples appear at evaluation steps";
  for (const { name, s } of parts) {
    const pre = el("pre", "sample");
    pre.append(el("span", "prompt", String(s.prompt ?? "")), document.createTextNode(String(s.text ?? "")));
    box.append(el("div", "sample-head", `${name} · step ${s.step}`), pre);
  }
}

// --- Controls and the poll loop. ---

$("xaxis").onchange = (e) => { state.x = e.target.value; renderGrid(); };
$("logscale").onchange = (e) => { state.log = e.target.checked; renderGrid(); };
$("filter").oninput = (e) => { state.filter = e.target.value; renderGrid(); renderLegend(); };
$("hparams-all").onchange = () => renderHparams();
$("smoothing").oninput = (e) => {
  state.smoothing = Number(e.target.value);
  $("smoothing-value").textContent = e.target.value;
  renderGrid();
};
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && state.enlarged) toggleEnlarged(state.enlarged);
});
let resizing = null;
window.addEventListener("resize", () => {
  clearTimeout(resizing);
  resizing = setTimeout(renderGrid, 150);
});

async function loop() {
  try {
    await refreshRuns();
    document.body.dataset.ready = "1";
  } catch (e) {
    if (e instanceof Gone) serverGone();
    else $("logdir-status").textContent = `error: ${e.message}`;
  }
  renderServer();
  setTimeout(loop, POLL_MS);
}
loop();
