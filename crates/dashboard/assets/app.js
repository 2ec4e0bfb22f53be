// ember dashboard: polls the run list and each shown run's new metric rows every 2 s, and draws the
// chosen metric of every ticked run on one uPlot chart. State for tests and curious users: window.ember.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const POLL_MS = 2000;

const state = {
  runs: new Map(), // name -> { summary, cols: {key: [values]}, rows, color, selected, samples }
  metric: "train_loss",
  x: "step",
  smoothing: 0,
  log: false,
  chart: null,
  zoomed: false,
  layout: "",
  polls: 0,
};
window.ember = state;

const $ = (id) => document.getElementById(id);

async function getJson(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
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
  const summaries = await getJson("/api/runs");
  let changed = false;
  summaries.forEach((s) => {
    let run = state.runs.get(s.name);
    if (!run) {
      run = { summary: s, cols: {}, rows: 0, color: COLORS[state.runs.size % COLORS.length], selected: state.runs.size < 8, samples: [] };
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
    if (run.selected && run.summary.samples !== run.samples.length) {
      run.samples = await getJson(`/api/samples?run=${encodeURIComponent(name)}`);
      changed = true;
    }
  }
  $("logdir-status").textContent = `${state.runs.size} run${state.runs.size === 1 ? "" : "s"} · updated ${new Date().toLocaleTimeString()}`;
  renderRunList();
  renderMetricChoices();
  if (changed || !state.chart) renderChart();
  renderSamples();
  state.polls += 1;
  document.body.dataset.polls = state.polls;
}

function renderRunList() {
  const ul = $("runs");
  const names = [...state.runs.keys()];
  if (ul.dataset.names === names.join("\n") && ul.children.length === names.length) {
    names.forEach((name, i) => { ul.children[i].querySelector(".meta").textContent = meta(state.runs.get(name)); });
    return;
  }
  ul.dataset.names = names.join("\n");
  ul.innerHTML = "";
  for (const name of names) {
    const run = state.runs.get(name);
    const li = document.createElement("li");
    li.dataset.run = name;
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = run.selected;
    box.onchange = () => { run.selected = box.checked; refreshRuns().then(renderChart); };
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = run.color;
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = name;
    label.onclick = () => showConfig(name);
    const info = document.createElement("span");
    info.className = "meta muted";
    info.textContent = meta(run);
    li.append(box, swatch, label, info);
    ul.append(li);
  }
}

function meta(run) {
  const s = run.summary;
  const step = s.last_step === null || s.last_step === undefined ? "–" : s.last_step;
  return `step ${step}${s.updated_s < 10 ? " · live" : ""}`;
}

async function showConfig(name) {
  $("config-run").textContent = name;
  const text = await getJson(`/api/config?run=${encodeURIComponent(name)}`);
  $("config").textContent = text || "(no config.toml)";
}

function renderMetricChoices() {
  const keys = new Set();
  for (const run of state.runs.values()) if (run.selected) Object.keys(run.cols).forEach((k) => keys.add(k));
  ["step", "elapsed_s"].forEach((k) => keys.delete(k));
  const sel = $("metric");
  const list = [...keys].sort();
  if (sel.dataset.keys === list.join(",")) return;
  sel.dataset.keys = list.join(",");
  sel.innerHTML = "";
  for (const k of list) {
    const o = document.createElement("option");
    o.value = o.textContent = k;
    sel.append(o);
  }
  if (!keys.has(state.metric) && list.length) state.metric = list.includes("train_loss") ? "train_loss" : list[0];
  sel.value = state.metric;
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

function chartData() {
  const shown = [...state.runs.entries()].filter(([, r]) => r.selected);
  const tables = [];
  const series = [];
  for (const [name, run] of shown) {
    const xs = run.cols[state.x] || [];
    const ys = smooth(run.cols[state.metric] || [], state.smoothing);
    const px = [], py = [];
    for (let i = 0; i < xs.length; i++) {
      const y = ys[i];
      if (xs[i] === null || y === null || y === undefined || (state.log && y <= 0)) continue;
      px.push(xs[i]);
      py.push(y);
    }
    tables.push([px, py]);
    series.push({ name, run, points: px.length });
  }
  return { data: tables.length ? uPlot.join(tables) : [[]], series };
}

function renderChart() {
  const { data, series } = chartData();
  const layout = JSON.stringify([state.metric, state.x, state.log, series.map((s) => s.name)]);
  const el = $("chart");
  if (state.chart && state.layout === layout) {
    state.chart.setData(data, !state.zoomed);
  } else {
    if (state.chart) state.chart.destroy();
    state.zoomed = false;
    const opts = {
      width: Math.max(400, el.clientWidth || 900),
      height: 420,
      scales: { x: { time: false }, y: state.log ? { distr: 3 } : {} },
      axes: [{ label: state.x === "step" ? "step" : "wall time (s)" }, { label: state.metric }],
      series: [{ label: state.x }].concat(series.map((s) => ({ label: s.name, stroke: s.run.color, width: 1.5, spanGaps: true }))),
      cursor: { drag: { x: true, y: false } },
      hooks: {
        setSelect: [() => { state.zoomed = true; }],
        ready: [(u) => u.over.addEventListener("dblclick", () => { state.zoomed = false; })],
      },
    };
    state.chart = new uPlot(opts, data, el);
    state.layout = layout;
  }
  const status = $("chart-status");
  status.dataset.metric = state.metric;
  status.dataset.series = String(series.length);
  status.dataset.points = JSON.stringify(Object.fromEntries(series.map((s) => [s.name, s.points])));
}

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
    const head = document.createElement("div");
    head.className = "sample-head";
    head.textContent = `${name} · step ${s.step}`;
    const pre = document.createElement("pre");
    pre.textContent = s.prompt + s.text;
    box.append(head, pre);
  }
}

$("metric").onchange = (e) => { state.metric = e.target.value; renderChart(); };
$("xaxis").onchange = (e) => { state.x = e.target.value; renderChart(); };
$("logscale").onchange = (e) => { state.log = e.target.checked; renderChart(); };
$("smoothing").oninput = (e) => {
  state.smoothing = Number(e.target.value);
  $("smoothing-value").textContent = e.target.value;
  renderChart();
};
window.addEventListener("resize", () => { if (state.chart) state.chart.setSize({ width: $("chart").clientWidth, height: 420 }); });

async function loop() {
  try {
    await refreshRuns();
    document.body.dataset.ready = "1";
  } catch (e) {
    $("logdir-status").textContent = `error: ${e.message}`;
  }
  setTimeout(loop, POLL_MS);
}
loop();
