// The daemon's status page: polls /v1/stats, /v1/sessions and /v1/decisions and
// redraws. No build step and nothing from a CDN: the daemon serves this file as is.
// Over TCP the API needs the bearer token: open /ui#token=TOKEN once; it is kept in
// this tab's sessionStorage and taken out of the address bar.
"use strict";

const params = new URLSearchParams(location.hash.slice(1));
if (params.has("token")) {
  sessionStorage.setItem("kvstore-token", params.get("token"));
  params.delete("token");
  history.replaceState(null, "", location.pathname + (params.toString() ? "#" + params : ""));
}
const REFRESH_MS = Number(params.get("refresh")) || 2000;
const HISTORY = 150; // points kept for the charts
const COLORS = { lookups: "#1d232a", hbm: "#6a1b9a", dram: "#1565c0", ssd: "#2e7d32", redis: "#c62828" };
const history_ = { hitRate: {}, use: {} };
let previous = null;

async function api(path) {
  const token = sessionStorage.getItem("kvstore-token");
  const response = await fetch(path, { headers: token ? { Authorization: "Bearer " + token } : {} });
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    const message = body && body.error ? body.error.message : response.statusText;
    throw new Error(`${path}: ${response.status} ${message}`);
  }
  return body;
}

function cell(row, value, cls) {
  const td = row.insertCell();
  td.textContent = value;
  if (cls) td.className = cls;
  return td;
}

function fill(id, rows, draw) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const item of rows) draw(body.insertRow(), item);
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  for (n = Number(n) || 0; n >= 1024 && i < units.length - 1; i++) n /= 1024;
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + units[i];
}

const pct = (x) => (x == null || !isFinite(x) ? "-" : (100 * x).toFixed(1) + "%");
const num = (x) => (x == null ? "-" : Number(x).toFixed(3));

function duration(s) {
  if (s == null) return "-";
  if (s < 120) return s.toFixed(0) + "s";
  if (s < 7200) return (s / 60).toFixed(0) + "m";
  return (s / 3600).toFixed(1) + "h";
}

function drawTiers(stats) {
  const tiers = stats.store.tiers;
  const hits = Object.values(tiers).reduce((sum, t) => sum + t.hits, 0);
  fill("tiers", Object.entries(tiers), (row, [name, t]) => {
    row.dataset.tier = name;
    cell(row, name);
    cell(row, t.down ? "down" : "up", t.down ? "bad text" : "good text");
    cell(row, t.blocks);
    cell(row, bytes(t.used_bytes));
    cell(row, bytes(t.capacity_bytes));
    cell(row, pct(t.capacity_bytes ? t.used_bytes / t.capacity_bytes : null));
    cell(row, t.hits);
    cell(row, pct(hits ? t.hits / hits : null));
    cell(row, t.demotions);
    cell(row, t.evictions);
    cell(row, t.promotions);
    cell(row, t.corrupt_blocks, t.corrupt_blocks ? "bad" : "");
    cell(row, t.errors, t.errors ? "bad" : "");
  });
  const s = stats.store;
  document.getElementById("totals").textContent =
    `lookups ${s.lookups}, tokens asked ${s.lookup_tokens}, cached ${s.lookup_hit_tokens} ` +
    `(${pct(s.lookup_tokens ? s.lookup_hit_tokens / s.lookup_tokens : null)}); puts ${s.puts}, ` +
    `chunks stored ${s.chunks_stored}, dropped ${s.puts_dropped}`;
  // Over time: the hit rate of the lookups since the last refresh, and each tier's use.
  if (previous) {
    const asked = s.lookup_tokens - previous.store.lookup_tokens;
    const hit = s.lookup_hit_tokens - previous.store.lookup_hit_tokens;
    if (asked > 0) push((history_.hitRate.lookups ||= []), hit / asked);
    // Which tier served the chunk hits since the last refresh.
    const before = previous.store.tiers;
    const served = Object.entries(tiers).map(([name, t]) => [name, t.hits - (before[name] ? before[name].hits : 0)]);
    const total = served.reduce((sum, [, n]) => sum + n, 0);
    if (total > 0) for (const [name, n] of served) push((history_.hitRate[name] ||= []), n / total);
  }
  for (const [name, t] of Object.entries(tiers)) {
    push((history_.use[name] ||= []), t.capacity_bytes ? t.used_bytes / t.capacity_bytes : 0);
  }
  chart("hit-rate", history_.hitRate);
  chart("tier-use", history_.use);
  previous = stats;
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function chart(id, series) {
  const svg = document.getElementById(id);
  const legend = document.getElementById(id + "-legend");
  svg.replaceChildren();
  legend.replaceChildren();
  for (const [name, values] of Object.entries(series)) {
    if (!values.length) continue;
    const label = legend.appendChild(document.createElement("span"));
    label.textContent = `${name} ${pct(values[values.length - 1])}`;
    label.style.color = COLORS[name] || "#444";
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    const step = 300 / Math.max(1, HISTORY - 1);
    line.setAttribute("points", values.map((v, i) => `${i * step},${58 - 56 * v}`).join(" "));
    line.setAttribute("stroke", COLORS[name] || "#444");
    line.dataset.series = name;
    svg.appendChild(line);
    // The latest value as a dot, so a series is visible from its first refresh on.
    const dot = document.createElementNS("http://www.w3.org/2000/svg", "circle");
    dot.setAttribute("cx", String((values.length - 1) * step));
    dot.setAttribute("cy", String(58 - 56 * values[values.length - 1]));
    dot.setAttribute("r", "2.5");
    dot.setAttribute("fill", COLORS[name] || "#444");
    svg.appendChild(dot);
  }
}

function drawPredictor(p) {
  const text = document.getElementById("predictor");
  if (!p.enabled) {
    text.textContent = "predictor disabled";
    fill("quality", [], () => {});
    return;
  }
  const f = p.prefetches || {};
  text.textContent =
    `model ${p.model && p.model.source}; events ${p.events_processed} (dropped ${p.events_dropped}); ` +
    `idle sessions ${p.idle_sessions}; prefetches issued ${f.issued || 0}, used ${f.used || 0}, ` +
    `wasted ${f.wasted || 0}; demoted ${p.demoted_chunks || 0} chunks`;
  fill("quality", Object.entries(p.quality || {}), (row, [horizon, q]) => {
    cell(row, horizon + " s");
    cell(row, q.n);
    cell(row, pct(q.positive_rate));
    cell(row, num(q.predictor && q.predictor.auc));
    cell(row, num(q.last_gap && q.last_gap.auc));
    cell(row, num(q.predictor && q.predictor.brier));
    cell(row, num(q.base_rate && q.base_rate.brier));
    cell(row, num(q.last_gap && q.last_gap.brier));
  });
}

function forecast(f) {
  if (!f) return "-";
  return f.horizons_s.map((h, i) => `${duration(h)}: ${num(f.p_return[i])}`).join("  ");
}

function chain(c) {
  if (!c) return "-";
  return Object.entries(c.tiers).map(([tier, n]) => `${tier} ${n}`).join(", ");
}

function describe(d) {
  return d ? `${d.action} ${d.from || ""}→${d.to || ""}: ${d.reason}` : "-";
}

function drawSessions(listing, decisions) {
  const latest = {};
  for (const d of decisions) if (!(d.session in latest)) latest[d.session] = d;
  fill("sessions", listing.sessions || [], (row, s) => {
    row.dataset.session = s.session;
    cell(row, s.session);
    cell(row, s.active ? "running" : "idle", "text");
    cell(row, s.requests);
    cell(row, s.active || s.idle_since == null || listing.now == null ? "-" : duration(listing.now - s.idle_since));
    cell(row, forecast(s.forecast), "text");
    cell(row, chain(s.chain), "text");
    cell(row, describe(latest[s.session]), "reason");
  });
}

function drawDecisions(decisions) {
  fill("decisions", decisions.slice(0, 50), (row, d) => {
    cell(row, new Date(d.at * 1000).toISOString().slice(11, 19));
    cell(row, d.session, "text");
    cell(row, d.action, "text");
    cell(row, d.from || "-", "text");
    cell(row, d.to || "-", "text");
    cell(row, d.chunks);
    cell(row, d.reason, "reason");
  });
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const stats = await api("/v1/stats");
    const [listing, decided] = await Promise.all([
      api("/v1/sessions?limit=100"),
      stats.predictor.enabled ? api("/v1/decisions?limit=200") : { decisions: [] },
    ]);
    const d = stats.daemon;
    document.getElementById("daemon").textContent =
      `pid ${d.pid}, up ${duration(d.uptime_s)}, ${d.requests_served} requests, ` +
      `${d.leases_outstanding} leases` + (d.draining ? ", draining" : "");
    drawTiers(stats);
    drawPredictor(stats.predictor);
    drawSessions(listing, decided.decisions || []);
    drawDecisions(decided.decisions || []);
    document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
    error.hidden = true;
  } catch (failure) {
    error.textContent = String(failure.message || failure);
    error.hidden = false;
  }
  setTimeout(refresh, REFRESH_MS);
}

refresh();
