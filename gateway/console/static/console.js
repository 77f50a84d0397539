// The tinkerd console: one page, routed by the URL's #fragment. Every call goes to the gateway's
// API with the API key the user logged in with (kept in sessionStorage: this tab only), so the
// console shows exactly what the API shows that user. Data is put in the page as text nodes only.
"use strict";

const KEY = "tinkerd.apiKey";
const view = document.getElementById("view");

// ---- the API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function call(method, path, body) {
  const headers = { "X-API-Key": sessionStorage.getItem(KEY) || "" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (res.status === 401) { logout("Your key was refused (unknown, revoked or expired); log in again."); }
  return res;
}

async function api(method, path, body) {
  const res = await call(method, path, body);
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = { error: text }; }
  if (!res.ok) throw new ApiError(res.status, (data && (data.error || data.detail)) || res.statusText);
  return data;
}

// ---- DOM helpers: text only, never HTML built from data ------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

function table(headers, rows, attrs) {
  return el("table", attrs, el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))),
            el("tbody", {}, rows));
}

function show(...nodes) { view.replaceChildren(...nodes); }

function failure(e) { return el("p", { class: "error" }, e instanceof ApiError ? `${e.status}: ${e.message}` : String(e)); }

function bytes(n) {
  if (n == null) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function when(iso) { return iso ? new Date(iso).toLocaleString() : ""; }

function expiry(iso) {
  if (!iso) return "never";
  const left = (new Date(iso) - Date.now()) / 1000;
  const span = left > 86400 ? `${(left / 86400).toFixed(1)} d` : left > 3600 ? `${(left / 3600).toFixed(1)} h`
             : `${Math.max(0, Math.round(left / 60))} min`;
  return `${when(iso)} (in ${span})`;
}

function runLink(id) { return el("a", { href: `#/runs/${encodeURIComponent(id)}`, class: "mono" }, id); }

// A checkpoint's REST path: tinker://<run>/<kind>/<name> -> /api/v1/training_runs/<run>/checkpoints/<kind>/<name>
function checkpointRoute(c) {
  const rest = c.tinker_path.slice("tinker://".length);
  const run = rest.slice(0, rest.indexOf("/"));
  return `/api/v1/training_runs/${encodeURIComponent(run)}/checkpoints/${c.checkpoint_id.split("/").map(encodeURIComponent).join("/")}`;
}

// ---- login ---------------------------------------------------------------------------------

function logout(message) {
  sessionStorage.removeItem(KEY);
  document.getElementById("nav").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").textContent = "";
  view.replaceChildren();
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message || "";
}

async function login(key) {
  sessionStorage.setItem(KEY, key);
  try {
    const me = await api("GET", "/api/v1/auth/apikey/me");
    document.getElementById("who").textContent = `${me.name} (${me.details.org_details.org_id})`;
  } catch (e) {
    if (sessionStorage.getItem(KEY)) logout(e.message);
    return false;
  }
  document.getElementById("login").hidden = true;
  document.getElementById("nav").hidden = false;
  document.getElementById("logout").hidden = false;
  return true;
}

// ---- pages ---------------------------------------------------------------------------------

async function runsPage() {
  const data = await api("GET", "/api/v1/training_runs?limit=1000");
  const rows = data.training_runs.slice().reverse().map(r => el("tr", { "data-run-id": r.training_run_id },
    el("td", {}, runLink(r.training_run_id)), el("td", {}, r.base_model), el("td", {}, r.lora_rank),
    el("td", {}, when(r.last_request_time)),
    el("td", { class: "mono" }, r.last_checkpoint ? r.last_checkpoint.tinker_path : ""),
    el("td", { class: "mono" }, r.last_sampler_checkpoint ? r.last_sampler_checkpoint.tinker_path : "")));
  show(el("h1", {}, "Training runs"), el("p", { class: "muted" }, `${data.cursor.total_count} run(s), newest first`),
       table(["Run", "Base model", "LoRA rank", "Last request", "Last checkpoint", "Last sampler checkpoint"], rows,
             { id: "runs-table" }));
}

// Rows (one per request) -> one series per metric over optimizer steps. A step's forward_backward
// sums add up (several chunks or calls per step); loss:mean is recomputed from the sums.
function series(steps) {
  const perStep = new Map();
  for (const row of steps) {
    const prefix = row.kind === "forward" ? "forward " : "";
    const acc = perStep.get(row.step) || {};
    for (const [k, v] of Object.entries(row.metrics)) {
      if (k === "loss:mean") continue;
      const name = prefix + k;
      acc[name] = k.endsWith(":sum") ? (acc[name] || 0) + v : v;
    }
    perStep.set(row.step, acc);
  }
  for (const acc of perStep.values()) {
    for (const prefix of ["", "forward "]) {
      if (acc[prefix + "weights:sum"] > 0 && acc[prefix + "loss:sum"] !== undefined)
        acc[prefix + "loss:mean"] = acc[prefix + "loss:sum"] / acc[prefix + "weights:sum"];
    }
  }
  const out = new Map();
  for (const [step, acc] of [...perStep.entries()].sort((a, b) => a[0] - b[0])) {
    for (const [k, v] of Object.entries(acc)) {
      if (!out.has(k)) out.set(k, []);
      out.get(k).push([step, v]);
    }
  }
  const first = ["loss:mean", "loss:sum", "forward loss:mean", "learning_rate", "grad_norm:mean", "tokens:sum"];
  return [...out.entries()].sort((a, b) => {
    const ia = first.indexOf(a[0]), ib = first.indexOf(b[0]);
    return (ia < 0 ? 99 : ia) - (ib < 0 ? 99 : ib) || a[0].localeCompare(b[0]);
  });
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) { return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2) : +v.toFixed(4); }

// A metric that never changed: its value, labelled, instead of a flat line on an axis from v to v.
function constantChart(name, points, W, H, xLabel, unit) {
  const xs = points.map(p => p[0]), v = points[0][1];
  const g = svg("svg", { class: "chart constant", "data-metric": name, "data-constant": "true", "data-value": v,
                         width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  g.append(svg("text", { x: 12, y: 15, "font-weight": "bold" }, name));
  g.append(svg("text", { class: "value", x: W / 2, y: H / 2 + 6, "text-anchor": "middle" }, `${fmt(v)}${unit || ""}`));
  const span = xs.length > 1 ? `${xLabel(Math.min(...xs))} to ${xLabel(Math.max(...xs))}` : xLabel(xs[0]);
  g.append(svg("text", { x: W / 2, y: H / 2 + 30, "text-anchor": "middle" },
               `constant, ${points.length} point(s): ${span}`));
  return g;
}

// A line chart of [x, value] points (x: the step, unless `xLabel` says otherwise): an inline SVG,
// a polyline and a circle.point per point; a constant metric is drawn as its value (constantChart).
function chart(name, points, xLabel, unit) {
  const W = 420, H = 220, L = 58, R = 12, T = 24, B = 30;
  xLabel = xLabel || (x => `step ${x}`);
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y0 === y1) return constantChart(name, points, W, H, xLabel, unit);
  const sx = x => L + (x1 === x0 ? (W - L - R) / 2 : (x - x0) / (x1 - x0) * (W - L - R));
  const sy = y => T + (y1 === y0 ? (H - T - B) / 2 : (1 - (y - y0) / (y1 - y0)) * (H - T - B));
  const g = svg("svg", { class: "chart", "data-metric": name, width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  g.append(svg("text", { x: L, y: 15, "font-weight": "bold" }, name));
  g.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  g.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  g.append(svg("text", { x: L - 4, y: T + 4, "text-anchor": "end" }, fmt(y1)));
  g.append(svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, fmt(y0)));
  g.append(svg("text", { x: L, y: H - 10 }, xLabel(x0)));
  g.append(svg("text", { x: W - R, y: H - 10, "text-anchor": "end" }, xLabel(x1)));
  g.append(svg("polyline", { class: "line", points: points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
  // A dot per step while they can be told apart; a long run gets the line alone.
  for (const [x, y] of points.length <= 400 ? points : []) {
    const dot = svg("circle", { class: "point", cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 3, "data-step": x, "data-value": y });
    dot.append(svg("title", {}, `${xLabel(x)}: ${y}`));
    g.append(dot);
  }
  return g;
}

function checkpointsTable(checkpoints, refresh) {
  const rows = checkpoints.map(c => {
    const act = (method, suffix) => async () => {
      try { await api(method, checkpointRoute(c) + suffix); } catch (e) { alert(e.message); }
      refresh();
    };
    const buttons = [c.public ? el("button", { class: "unpublish", onclick: act("DELETE", "/publish") }, "Unpublish")
                              : el("button", { class: "publish", onclick: act("POST", "/publish") }, "Publish"),
                     el("button", { class: "delete", onclick: () => confirm(`Delete ${c.tinker_path}?`) && act("DELETE", "")() }, "Delete")];
    return el("tr", { "data-path": c.tinker_path }, el("td", { class: "mono" }, c.tinker_path), el("td", {}, c.checkpoint_type),
              el("td", {}, bytes(c.size_bytes)), el("td", {}, when(c.time)), el("td", {}, expiry(c.expires_at)),
              el("td", { class: "published" }, c.public ? "yes" : "no"), el("td", {}, buttons));
  });
  return table(["Path", "Type", "Size", "Saved", "Expires", "Published", ""], rows, { class: "checkpoints" });
}

async function runPage(runId) {
  const route = `/api/v1/training_runs/${encodeURIComponent(runId)}`;
  const [run, metrics, ckpts] = await Promise.all([
    api("GET", route), api("GET", `/api/v1/console/training_runs/${encodeURIComponent(runId)}/metrics`),
    api("GET", route + "/checkpoints")]);
  const curves = series(metrics.steps);
  const optimSteps = metrics.steps.filter(s => s.kind === "optim_step").length;
  const recent = metrics.steps.slice(-50).reverse().map(s => el("tr", {}, el("td", {}, s.step), el("td", {}, s.seq_id),
    el("td", {}, s.kind), el("td", { class: "mono" }, Object.entries(s.metrics).map(([k, v]) => `${k}=${fmt(v)}`).join("  ")),
    el("td", {}, when(s.at))));
  show(el("h1", {}, "Training run ", el("span", { class: "mono", id: "run-id" }, run.training_run_id)),
       el("p", {}, `${run.base_model}, LoRA rank ${run.lora_rank}; ${optimSteps} optimizer step(s), ` +
                   `${metrics.steps.length} recorded request(s); last request ${when(run.last_request_time)}`),
       curves.length ? el("div", { class: "charts", id: "charts" }, curves.map(([name, pts]) => chart(name, pts)))
                     : el("p", { class: "muted", id: "charts" }, "No steps recorded yet."),
       el("h2", {}, "Checkpoints"), checkpointsTable(ckpts.checkpoints, () => route_()),
       el("h2", {}, "Latest requests"), table(["Step", "seq_id", "Kind", "Metrics", "At"], recent));
}

async function checkpointsPage() {
  const data = await api("GET", "/api/v1/checkpoints?limit=1000");
  show(el("h1", {}, "Checkpoints"),
       el("p", { class: "muted" }, `${data.cursor.total_count} checkpoint(s); published ones can be loaded by every user`),
       checkpointsTable(data.checkpoints.slice().reverse(), () => route_()));
}

async function sessionsPage() {
  const data = await api("GET", "/api/v1/console/sessions?limit=1000");
  // Grouped by project (newest first within one: the order the API gives).
  const sessions = data.sessions.slice().sort((a, b) => (a.project_id || "").localeCompare(b.project_id || ""));
  const rows = sessions.map(s => el("tr", { "data-session-id": s.session_id },
    el("td", { class: "mono" }, s.project_id || ""),
    el("td", {}, el("a", { href: `#/sessions/${encodeURIComponent(s.session_id)}`, class: "mono" }, s.session_id)),
    el("td", {}, s.display_name || ""),
    el("td", {}, when(s.created_at)), el("td", {}, when(s.last_heartbeat)), el("td", {}, s.closed ? "closed" : "open"),
    el("td", {}, s.tags.join(", ")), el("td", {}, s.training_run_ids.map(id => el("div", {}, runLink(id)))),
    el("td", { class: "mono" }, s.sampler_ids.map(id => el("div", {}, id)))));
  show(el("h1", {}, "Sessions"),
       table(["Project", "Session", "Name", "Created", "Last heartbeat", "State", "Tags", "Training runs",
              "Sampling sessions"], rows, { id: "sessions-table" }));
}

async function usagePage() {
  // The last 24 UTC hours (GET /api/v1/billing/usage/events), summed per project, user and kind.
  const end = new Date();
  end.setUTCMinutes(0, 0, 0);
  end.setUTCHours(end.getUTCHours() + 1);
  const start = new Date(end - 24 * 3600e3);
  const window_ = `starting_on=${encodeURIComponent(start.toISOString())}&ending_before=${encodeURIComponent(end.toISOString())}`;
  const [usage, storage] = await Promise.all([api("GET", `/api/v1/billing/usage/events?${window_}`),
                                              api("GET", "/api/v1/billing/usage/checkpoints/current")]);
  const totals = new Map();
  for (const e of usage.data) {
    const info = e.event_info, user = e.user_name || e.user_id || "";
    const key = [e.project_id || "", user, info.type].join("\u0000");
    const t = totals.get(key) || { project: e.project_id || "", user, kind: info.type, quantity: 0, cost: null };
    t.quantity += info.token_count ?? info.count ?? info.gigabyte_hours ?? 0;
    if (e.estimated_cost_usd != null) t.cost = (t.cost || 0) + e.estimated_cost_usd;
    totals.set(key, t);
  }
  const rows = [...totals.values()].sort((a, b) => (a.project + a.user + a.kind).localeCompare(b.project + b.user + b.kind))
    .map(t => el("tr", { "data-kind": t.kind, "data-user": t.user },
      el("td", { class: "mono" }, t.project), el("td", {}, t.user), el("td", {}, t.kind),
      el("td", { class: "quantity" }, t.kind === "storage" ? `${t.quantity.toPrecision(3)} GB-h` : String(t.quantity)),
      el("td", {}, t.cost == null ? "" : `$${t.cost.toFixed(4)}`)));
  const stored = storage.data.map(r => el("tr", {}, el("td", { class: "mono" }, r.project_id || ""),
    el("td", {}, r.user_name || r.org_user_urn || ""), el("td", {}, String(r.checkpoint_count)), el("td", {}, bytes(r.size_bytes))));
  show(el("h1", {}, "Usage"),
       el("p", { class: "muted" }, `Since ${start.toISOString()} (UTC hours): tokens trained, prefilled and sampled, ` +
          "checkpoints made and their storage; an admin sees every user of the organization"),
       table(["Project", "User", "Kind", "Quantity", "Estimated cost"], rows, { id: "usage-table" }),
       el("h2", {}, "Checkpoint storage now"),
       table(["Project", "User", "Checkpoints", "Size"], stored, { id: "storage-table" }));
}

async function snapshotsPage() {
  const [ckpts, sampling] = await Promise.all([api("GET", "/api/v1/checkpoints?limit=1000"),
                                               api("GET", "/api/v1/console/sampling_sessions?limit=1000")]);
  const snapshots = ckpts.checkpoints.filter(c => c.checkpoint_type === "sampler").reverse();
  const rows = snapshots.map(c => el("tr", {}, el("td", { class: "mono" }, c.tinker_path), el("td", {}, bytes(c.size_bytes)),
    el("td", {}, when(c.time)), el("td", {}, expiry(c.expires_at)), el("td", {}, c.public ? "yes" : "no"),
    el("td", {}, el("a", { href: `#/playground/${encodeURIComponent(c.tinker_path)}` }, "Sample"))));
  const sessRows = sampling.sampling_sessions.map(s => el("tr", {}, el("td", { class: "mono" }, s.sampling_session_id),
    el("td", { class: "mono" }, s.model_path || `${s.base_model} (base)`), el("td", {}, when(s.created_at))));
  show(el("h1", {}, "Sampler snapshots"),
       table(["Snapshot", "Size", "Saved", "Expires", "Published", ""], rows, { id: "snapshots-table" }),
       el("h2", {}, "Sampling sessions"), table(["Sampling session", "Samples from", "Created"], sessRows));
}

// ---- a session: the hosted console's four panels, step times, latency, trace export ----------

function seconds(x) { return x >= 3600 ? `${(x / 3600).toFixed(1)} h` : x >= 60 ? `${(x / 60).toFixed(1)} min` : `${+x.toFixed(1)} s`; }

function panel(id, title, summary, ...body) {
  return el("div", { class: "panel", "data-panel": id }, el("h3", {}, title), el("p", { class: "summary" }, summary), ...body);
}

// A series over the session's time (x: seconds since its first request), or a note if empty.
function timeChart(name, points, unit) {
  return points.length ? chart(name, points, x => `+${seconds(x)}`, unit) : el("p", { class: "muted" }, "no data yet");
}

async function exportTrace(sessionId, out) {
  out.replaceChildren(el("span", { class: "muted" }, "building the trace..."));
  try {
    const r = await api("GET", `/api/v1/sessions/${encodeURIComponent(sessionId)}/trace_export`);
    out.replaceChildren(el("a", { id: "trace-link", href: r.url, download: `${sessionId}.pftrace` }, `${sessionId}.pftrace`),
                        " (open it in ui.perfetto.dev; the link works for an hour, without a key)");
  } catch (e) { out.replaceChildren(failure(e)); }
}

async function sessionPage(sessionId) {
  const m = await api("GET", `/api/v1/console/sessions/${encodeURIComponent(sessionId)}/metrics`);
  const tok = m.tokens_per_s, util = m.training_utilization, inflight = m.in_flight_samples;
  const mean = pts => pts.length ? pts.reduce((a, p) => a + p[1], 0) / pts.length : 0;
  const latencyRows = Object.entries(m.latency).map(([kind, v]) => el("tr", { "data-kind": kind },
    el("td", {}, kind), el("td", {}, v.count), el("td", {}, seconds(v.p50_s)), el("td", {}, seconds(v.p90_s)),
    el("td", {}, seconds(v.p99_s)), el("td", {}, seconds(v.max_s))));
  const refusals = m.rate_limit_events.map(e => el("tr", {}, el("td", {}, new Date(e.at_us / 1000).toLocaleString()),
                                                 el("td", {}, e.detail)));
  const traceOut = el("span", { id: "trace-out" });
  show(el("h1", {}, "Session ", el("span", { class: "mono", id: "session-id" }, m.session_id)),
       el("p", {}, `${m.requests} request(s) recorded (up to ${m.span_budget} kept), ${m.rate_limited} rate-limit ` +
                   `refusal(s)` + (m.bucket_s ? `; each point is ${seconds(m.bucket_s)}` : ""), " ",
          el("button", { id: "refresh", onclick: () => route_() }, "Refresh"), " ",
          el("button", { id: "export-trace", onclick: () => exportTrace(m.session_id, traceOut) }, "Export trace (.pftrace)"),
          " ", traceOut),
       el("div", { class: "panels", id: "session-panels" },
          panel("in-flight-samples", "In-flight sample requests", `${inflight.now} now`,
                timeChart("samples in flight", inflight.series)),
          panel("training-utilization", "Training utilization", `${(100 * util.mean).toFixed(1)}% of the time`,
                timeChart("trainer busy (fraction)", util.series)),
          panel("tokens-per-second", "Tokens per second",
                `training ${fmt(mean(tok.training))}, generation ${fmt(mean(tok.generation))}, prefill ${fmt(mean(tok.prefill))} (mean)`,
                timeChart("training tokens/s", tok.training), timeChart("generation tokens/s", tok.generation),
                timeChart("prefill tokens/s", tok.prefill)),
          panel("step-time", "Step time", m.step_times.length ? `${m.step_times.length} training run(s)` : "no optimizer steps yet",
                m.step_times.map(r => chart(`step time, ${r.model_id}`, r.points, undefined, " s")))),
       el("h2", {}, "Latency, received to finished"),
       table(["Request", "Count", "p50", "p90", "p99", "max"], latencyRows, { id: "latency-table" }),
       el("h2", {}, "Rate-limit refusals (latest 50)"),
       table(["At", "Refusal"], refusals.length ? refusals : [el("tr", {}, el("td", { colspan: 2, class: "muted" }, "none"))],
             { id: "refusals-table" }));
}

let queueTimer = null;

async function queuePage() {
  const data = await api("GET", "/api/v1/console/queue");
  const rows = Object.entries(data.pending).filter(([, n]) => n > 0)
    .map(([kind, n]) => el("tr", { "data-kind": kind }, el("td", {}, kind), el("td", {}, n)));
  show(el("h1", {}, "Queue"),
       el("p", {}, `${data.total} of your request(s) waiting or running on this gateway (refreshed every 2 s)`),
       table(["Request type", "Pending"], rows.length ? rows : [el("tr", {}, el("td", { colspan: 2, class: "muted" }, "nothing pending"))],
             { id: "queue-table" }));
  queueTimer = setTimeout(() => { if (location.hash === "#/queue") route_(); }, 2000);
}

// ---- the playground: create_sampling_session + asample + retrieve_future, as the SDK does ----

function consoleSession() {
  const saved = JSON.parse(sessionStorage.getItem("tinkerd.playground") || "null");
  return saved && saved.key === sessionStorage.getItem(KEY) ? saved : null;
}

async function samplingSession(model) {
  let state = consoleSession();
  if (!state) {
    const s = await api("POST", "/api/v1/create_session", { tags: ["console"], user_metadata: {} });
    state = { key: sessionStorage.getItem(KEY), session_id: s.session_id, samplers: {}, seq: {} };
  }
  if (!state.samplers[model]) {
    const body = { session_id: state.session_id, sampling_session_seq_id: Object.keys(state.samplers).length };
    if (model.startsWith("tinker://")) body.model_path = model; else body.base_model = model;
    state.samplers[model] = (await api("POST", "/api/v1/create_sampling_session", body)).sampling_session_id;
  }
  const sid = state.samplers[model];
  const seq = state.seq[sid] || 0;
  state.seq[sid] = seq + 1;
  sessionStorage.setItem("tinkerd.playground", JSON.stringify(state));
  return [sid, seq];
}

async function result(requestId) {
  for (;;) {
    const res = await call("POST", "/api/v1/retrieve_future", { request_id: requestId });
    if (res.status === 408) continue;             // still pending: poll again
    if (!res.ok || (res.headers.get("content-type") || "").includes("json")) {
      const data = await res.json();
      throw new ApiError(res.status, data.error || JSON.stringify(data));
    }
    return new Uint8Array(await res.arrayBuffer());
  }
}

// The asample result is the SDK's SampleResponse protobuf: sequences = 1 (SampledSequence:
// stop_reason = 1, tokens = 2 as little-endian int32 bytes). A minimal reader of those fields.
function protoFields(buf) {
  const out = [];
  let pos = 0;
  const varint = () => {
    let v = 0, mul = 1, b;
    do { b = buf[pos++]; v += (b & 0x7f) * mul; mul *= 128; } while (b & 0x80);
    return v;
  };
  while (pos < buf.length) {
    const tag = varint(), no = Math.floor(tag / 8), wire = tag & 7;
    if (wire === 0) out.push([no, varint()]);
    else if (wire === 2) { const n = varint(); out.push([no, buf.subarray(pos, pos + n)]); pos += n; }
    else if (wire === 1) pos += 8;
    else if (wire === 5) pos += 4;
    else throw new Error(`unexpected protobuf wire type ${wire}`);
  }
  return out;
}

function sampledSequences(buf) {
  return protoFields(buf).filter(([no]) => no === 1).map(([, seq]) => {
    const s = { stop: 0, tokens: [] };
    for (const [no, v] of protoFields(seq)) {
      if (no === 1) s.stop = v;
      if (no === 2) { const dv = new DataView(v.buffer, v.byteOffset, v.byteLength); for (let i = 0; i + 4 <= v.byteLength; i += 4) s.tokens.push(dv.getInt32(i, true)); }
    }
    return s;
  });
}

async function playgroundPage(preselected) {
  const [ckpts, caps] = await Promise.all([api("GET", "/api/v1/checkpoints?limit=1000"),
                                           api("GET", "/api/v1/get_server_capabilities")]);
  const models = ckpts.checkpoints.filter(c => c.checkpoint_type === "sampler").reverse().map(c => c.tinker_path)
    .concat(caps.supported_models.map(m => m.model_name));
  if (preselected && !models.includes(preselected)) models.unshift(preselected);
  const select = el("select", { id: "pg-model" }, models.map(m => el("option", { value: m }, m)));
  if (preselected) select.value = preselected;
  const prompt = el("textarea", { id: "pg-prompt" }, "The quick brown fox");
  const maxTokens = el("input", { id: "pg-max-tokens", type: "number", value: 32, min: 1 });
  const temperature = el("input", { id: "pg-temperature", type: "number", value: 0.7, min: 0, step: 0.1 });
  const n = el("input", { id: "pg-n", type: "number", value: 1, min: 1, max: 8 });
  const out = el("div", { class: "samples", id: "pg-output" });
  const go = el("button", { id: "pg-sample" }, "Sample");
  go.addEventListener("click", async () => {
    go.disabled = true;
    out.replaceChildren(el("p", { class: "muted" }, "sampling..."));
    try {
      const [sid, seq] = await samplingSession(select.value);
      const tokens = (await api("POST", "/api/v1/console/tokenize", { text: prompt.value })).tokens;
      const future = await api("POST", "/api/v1/asample", {
        sampling_session_id: sid, seq_id: seq, num_samples: +n.value,
        prompt: { chunks: [{ type: "encoded_text", tokens }] },
        sampling_params: { max_tokens: +maxTokens.value, temperature: +temperature.value } });
      const seqs = sampledSequences(await result(future.request_id));
      const texts = await Promise.all(seqs.map(s => api("POST", "/api/v1/console/detokenize", { tokens: s.tokens })));
      out.replaceChildren(...seqs.map((s, i) => el("div", { class: "sample" },
        el("pre", {}, el("span", { class: "muted" }, prompt.value), texts[i].text),
        el("p", { class: "muted" }, `${s.tokens.length} token(s), stopped by ${s.stop === 1 ? "length" : "stop"}`))));
    } catch (e) {
      out.replaceChildren(failure(e));
    } finally {
      go.disabled = false;
    }
  });
  show(el("h1", {}, "Playground"),
       el("p", {}, el("label", {}, "Model or snapshot ", select)),
       el("p", {}, prompt),
       el("p", {}, el("label", {}, "max_tokens ", maxTokens), " ", el("label", {}, "temperature ", temperature), " ",
          el("label", {}, "samples ", n), " ", go),
       out);
}

// ---- routing -------------------------------------------------------------------------------

async function route_() {
  clearTimeout(queueTimer);
  const [, page, ...rest] = (location.hash || "#/runs").split("/");
  const arg = rest.length ? decodeURIComponent(rest.join("/")) : "";
  for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.getAttribute("href") === `#/${page}`);
  const pages = { runs: () => arg ? runPage(arg) : runsPage(), checkpoints: checkpointsPage,
                  sessions: () => arg ? sessionPage(arg) : sessionsPage(),
                  snapshots: snapshotsPage, queue: queuePage, usage: usagePage, playground: () => playgroundPage(arg) };
  try {
    await (pages[page] || runsPage)();
  } catch (e) {
    if (sessionStorage.getItem(KEY)) show(failure(e));
  }
}

document.getElementById("login").addEventListener("submit", async ev => {
  ev.preventDefault();
  if (await login(document.getElementById("api-key").value.trim())) route_();
});
document.getElementById("logout").addEventListener("click", () => logout(""));
window.addEventListener("hashchange", () => { if (sessionStorage.getItem(KEY)) route_(); });

(async () => {
  const saved = sessionStorage.getItem(KEY);
  if (saved && await login(saved)) route_();
  else logout("");
})();
