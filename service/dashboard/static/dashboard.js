// Kiln dashboard: live job list (one SSE stream per tenant), model upload, latency bars and the
// fusion graph (SVG, laid out here). User text only ever reaches the page as textContent.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const MAPPING_COLOURS = {
  "One-to-One": "#3fa34d", "Reorganize": "#2a9d8f", "Shuffle": "#7b61c4",
  "One-to-Many": "#e9a23b", "Many-to-Many": "#d1495b",
};

function csrfToken() {
  const meta = document.querySelector('meta[name="csrf-token"]');
  return meta ? meta.content : "";
}

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

// --- jobs --------------------------------------------------------------------------------------

function followJobs(onEvent) {
  const source = new EventSource("/jobs/events");
  source.addEventListener("job", (e) => onEvent(JSON.parse(e.data)));
  return source;
}

function updateJobRow(row, job) {
  row.dataset.state = job.state;
  const state = row.querySelector(".state");
  state.textContent = job.state;
  state.className = `state state-${job.state}`;
  row.querySelector("progress").value = job.progress;
  row.querySelector(".stage").textContent = job.stage || "";
  if (!["queued", "running"].includes(job.state)) {
    const cancel = row.querySelector("form.cancel");
    if (cancel) cancel.remove();
  }
}

function initJobs() {
  let reloading = false;
  followJobs((job) => {
    const row = document.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
    if (row) updateJobRow(row, job);
    else if (!reloading && !location.search) {
      reloading = true;
      setTimeout(() => location.reload(), 300);
    }
  });
  const form = document.getElementById("upload");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const file = document.getElementById("model-file").files[0];
    const status = document.getElementById("upload-status");
    if (!file) return;
    status.textContent = `uploading ${file.name}…`;
    const params = new URLSearchParams({
      filename: file.name, target: document.getElementById("target").value,
      partitioner: document.getElementById("partitioner").value,
      shapes: document.getElementById("shapes").value,
    });
    const reply = await fetch(`/jobs/upload?${params}`, {
      method: "POST", body: file, credentials: "same-origin",
      headers: {"Content-Type": "application/octet-stream", "X-CSRF-Token": csrfToken()},
    });
    const body = await reply.json().catch(() => ({detail: reply.statusText}));
    if (reply.ok) {
      status.textContent = `queued job ${body.job_id}`;
      location.reload();
    } else {
      status.textContent = `refused: ${body.detail}`;
      status.classList.add("error");
    }
  });
}

// --- job page ----------------------------------------------------------------------------------

function initJob() {
  const state = document.getElementById("job-state");
  if (state && state.dataset.terminal === "no") {
    const source = followJobs((job) => {
      if (job.id === state.dataset.job && !["queued", "running"].includes(job.state)) {
        source.close();
        location.reload();
      }
    });
  }
  const pending = document.querySelectorAll('#profile-runs tr[data-state="queued"], ' +
                                            '#profile-runs tr[data-state="running"]');
  if (pending.length) pollProfileRuns(state.dataset.job);
  for (const el of document.querySelectorAll("[data-left]")) el.style.left = `${el.dataset.left}%`;
  for (const el of document.querySelectorAll("[data-width]")) el.style.width = `${el.dataset.width}%`;
  const data = document.getElementById("plan-data");
  if (data) drawGraph(JSON.parse(data.textContent), document.getElementById("graph"));
}

function pollProfileRuns(jobId) {
  const timer = setInterval(async () => {
    const reply = await fetch(`/jobs/${encodeURIComponent(jobId)}/profile.json`,
                              {credentials: "same-origin"});
    if (!reply.ok) return;
    const runs = await reply.json();
    if (!runs.some((r) => r.state === "queued" || r.state === "running")) {
      clearInterval(timer);
      location.reload();
    }
  }, 1000);
}

// --- the fusion graph --------------------------------------------------------------------------

const NODE_W = 64, NODE_H = 22, COL = 88, ROW = 32, PAD = 8, GAP = 28;

function longestPaths(count, edges) {
  // edges: [from, to] index pairs with from < to in topological order
  const depth = new Array(count).fill(0);
  const incoming = Array.from({length: count}, () => []);
  for (const [a, b] of edges) incoming[b].push(a);
  for (let i = 0; i < count; i++) for (const a of incoming[i]) depth[i] = Math.max(depth[i], depth[a] + 1);
  return depth;
}

function layout(plan, aspect) {
  // Each block is a box of its own (ops by their depth inside the block); blocks go in columns
  // by their depth in the block graph, and the columns wrap into bands, so that the whole plan
  // fits the panel's shape and block boxes never overlap.
  const index = new Map(plan.ops.map((op, i) => [op.id, i]));
  const blocks = plan.blocks.map((b) => ({...b, members: b.ops.filter((id) => index.has(id))}));
  const blockAt = new Map(blocks.map((b, i) => [b.id, i]));
  plan.ops.forEach((op) => {  // an op outside every block gets a box of its own
    if (!blockAt.has(op.block)) {
      blockAt.set(op.block ?? op.id, blocks.length);
      blocks.push({id: op.block ?? op.id, name: op.id, mapping: op.mapping, ops: [op.id], members: [op.id]});
    }
  });
  const blockOfOp = plan.ops.map((op) => blockAt.get(op.block ?? op.id));
  const opEdges = plan.edges.map((e) => [index.get(e.from), index.get(e.to)]).filter(([a, b]) => a !== undefined && b !== undefined);
  const inner = opEdges.filter(([a, b]) => blockOfOp[a] === blockOfOp[b]);
  const local = longestPaths(plan.ops.length, inner);
  const lane = new Array(plan.ops.length).fill(0);
  for (const b of blocks) {
    const used = new Map();
    for (const id of b.members) {
      const i = index.get(id);
      lane[i] = used.get(local[i]) || 0;
      used.set(local[i], lane[i] + 1);
    }
    b.w = (Math.max(...b.members.map((id) => local[index.get(id)])) + 1) * COL - (COL - NODE_W) + 2 * PAD;
    b.h = Math.max(...used.values()) * ROW - (ROW - NODE_H) + 2 * PAD;
  }
  const blockEdges = opEdges.map(([a, b]) => [blockOfOp[a], blockOfOp[b]]).filter(([a, b]) => a < b);
  const level = longestPaths(blocks.length, blockEdges);
  const columns = [];
  blocks.forEach((b, i) => { (columns[level[i]] ||= []).push(b); });
  const cols = columns.filter(Boolean).map((members) => ({
    members, w: Math.max(...members.map((b) => b.w)),
    h: members.reduce((sum, b) => sum + b.h + GAP / 2, 0),
  }));
  const totalW = cols.reduce((sum, c) => sum + c.w + GAP, 0);
  const tallest = Math.max(...cols.map((c) => c.h));
  const bandW = Math.max(Math.sqrt(aspect * totalW * (tallest + GAP)), ...cols.map((c) => c.w + GAP));
  let x = 0, y = 0, bandH = 0;
  for (const c of cols) {
    if (x > 0 && x + c.w > bandW) { x = 0; y += bandH + GAP * 2; bandH = 0; }
    let cy = y;
    for (const b of c.members) { b.x = x; b.y = cy; cy += b.h + GAP / 2; }
    bandH = Math.max(bandH, c.h);
    x += c.w + GAP;
  }
  const pos = plan.ops.map((op, i) => {
    const b = blocks[blockOfOp[i]];
    return {x: b.x + PAD + local[i] * COL, y: b.y + PAD + lane[i] * ROW};
  });
  return {index, pos, blocks, width: Math.max(...blocks.map((b) => b.x + b.w)) + PAD,
          height: Math.max(...blocks.map((b) => b.y + b.h)) + PAD};
}

function drawGraph(plan, host) {
  const started = performance.now();
  const aspect = host.clientWidth / Math.max(host.clientHeight, 1);
  const {index, pos, blocks, width, height} = layout(plan, aspect);
  const root = svg("svg", {class: "plan", viewBox: `0 0 ${width} ${height}`,
                           preserveAspectRatio: "xMinYMin meet"});
  const groups = svg("g", {class: "blocks"}, root);
  const lines = svg("g", {class: "edges"}, root);
  const nodes = svg("g", {class: "ops"}, root);
  const blockOf = new Map(plan.blocks.map((b) => [b.id, b]));
  for (const block of blocks) {
    const rect = svg("rect", {x: block.x, y: block.y, width: block.w, height: block.h, rx: 6,
                              fill: MAPPING_COLOURS[block.mapping] || "#999",
                              class: block.view ? "block view" : "block", "data-block": block.id},
                     groups);
    if (!blockOf.has(block.id)) rect.setAttribute("class", "loose");
    svg("title", {}, rect).textContent =
      `${block.id} ${block.name}: ${block.mapping}${block.anchor ? `, anchor ${block.anchor}` : ""}` +
      `${block.view ? " (view)" : ""}, ${block.ops.length} ops`;
  }
  for (const e of plan.edges) {
    const a = pos[index.get(e.from)], b = pos[index.get(e.to)];
    if (!a || !b) continue;
    const far = Math.abs(a.y - b.y) > 3 * ROW ? " far" : "";  // between bands: kept faint
    svg("line", {x1: a.x + NODE_W, y1: a.y + NODE_H / 2, x2: b.x, y2: b.y + NODE_H / 2,
                 class: (e.internal ? "edge internal" : "edge") + far}, lines);
  }
  plan.ops.forEach((op, i) => {
    const g = svg("g", {class: "op", transform: `translate(${pos[i].x},${pos[i].y})`,
                        "data-op": op.id}, nodes);
    svg("rect", {width: NODE_W, height: NODE_H, rx: 3,
                 stroke: MAPPING_COLOURS[op.mapping] || "#999"}, g);
    const label = svg("text", {x: NODE_W / 2, y: NODE_H / 2 + 4, "text-anchor": "middle"}, g);
    label.textContent = op.type.length > 10 ? `${op.type.slice(0, 9)}…` : op.type;
    const block = blockOf.get(op.block);
    svg("title", {}, g).textContent = `${op.type} ${op.name || ""} (${op.id}, ` +
      `${op.mapping}; block ${op.block}${block ? ` ${block.name}` : ""})`;
  });
  host.replaceChildren(root);
  legend(plan);
  const view = {x: 0, y: 0, w: width, h: height, full: {w: width, h: height}};
  enableZoom(root, view);
  fit(root, view, host);
  const ms = performance.now() - started;
  host.dataset.rendered = "1";
  host.dataset.ops = String(plan.ops.length);
  host.dataset.renderMs = ms.toFixed(1);
  host.dataset.readyAt = performance.now().toFixed(1);  // since navigation started
  document.getElementById("graph-status").textContent =
    `${plan.ops.length} ops, ${plan.blocks.length} blocks, ${plan.edges.length} edges`;
}

function legend(plan) {
  const used = new Set(plan.blocks.map((b) => b.mapping));
  const host = document.getElementById("legend");
  host.replaceChildren();
  for (const [name, colour] of Object.entries(MAPPING_COLOURS)) {
    if (!used.has(name)) continue;
    const item = document.createElement("span");
    item.className = "swatch";
    const box = document.createElement("i");
    box.style.background = colour;
    item.append(box, document.createTextNode(name));
    host.appendChild(item);
  }
}

function setView(root, v) { root.setAttribute("viewBox", `${v.x} ${v.y} ${v.w} ${v.h}`); }

function fit(root, v, host) {
  // The whole plan; a small one at its own size, never blown up.
  v.x = 0; v.y = 0; v.w = Math.max(v.full.w, host.clientWidth); v.h = Math.max(v.full.h, host.clientHeight);
  setView(root, v);
}

function zoomAt(root, v, factor, cx, cy) {
  const w = v.w * factor, h = v.h * factor;
  v.x = cx - (cx - v.x) * factor; v.y = cy - (cy - v.y) * factor; v.w = w; v.h = h;
  setView(root, v);
}

function enableZoom(root, v) {
  const host = root.parentNode;
  const point = (event) => {
    const r = root.getBoundingClientRect();
    return [v.x + (event.clientX - r.left) / r.width * v.w, v.y + (event.clientY - r.top) / r.height * v.h];
  };
  root.addEventListener("wheel", (event) => {
    event.preventDefault();
    const [cx, cy] = point(event);
    zoomAt(root, v, event.deltaY > 0 ? 1.2 : 1 / 1.2, cx, cy);
  }, {passive: false});
  let drag = null;
  root.addEventListener("pointerdown", (event) => {
    drag = {x: event.clientX, y: event.clientY, vx: v.x, vy: v.y};
    root.setPointerCapture(event.pointerId);
  });
  root.addEventListener("pointermove", (event) => {
    if (!drag) return;
    const r = root.getBoundingClientRect();
    v.x = drag.vx - (event.clientX - drag.x) / r.width * v.w;
    v.y = drag.vy - (event.clientY - drag.y) / r.height * v.h;
    setView(root, v);
  });
  root.addEventListener("pointerup", () => { drag = null; });
  for (const button of document.querySelectorAll("[data-zoom]")) {
    button.addEventListener("click", () => {
      const how = button.dataset.zoom;
      if (how === "fit") fit(root, v, host);
      else zoomAt(root, v, how === "in" ? 1 / 1.5 : 1.5, v.x + v.w / 2, v.y + v.h / 2);
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  if (page === "jobs") initJobs();
  if (page === "job") initJob();
});
