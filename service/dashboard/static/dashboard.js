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

const NODE_W = 64, NODE_H = 22, COL = 96, ROW = 34, PAD = 7;

function layout(plan) {
  // x: longest path from the inputs; y: lane within that column, blocks kept together.
  const index = new Map(plan.ops.map((op, i) => [op.id, i]));
  const blockOrder = new Map(plan.blocks.map((b, i) => [b.id, i]));
  const preds = plan.ops.map(() => []);
  for (const e of plan.edges) preds[index.get(e.to)].push(index.get(e.from));
  const depth = new Array(plan.ops.length).fill(0);
  plan.ops.forEach((op, i) => {  // ops come in topological order
    for (const p of preds[i]) depth[i] = Math.max(depth[i], depth[p] + 1);
  });
  const columns = new Map();
  plan.ops.forEach((op, i) => {
    if (!columns.has(depth[i])) columns.set(depth[i], []);
    columns.get(depth[i]).push(i);
  });
  const pos = new Array(plan.ops.length);
  for (const [d, members] of columns) {
    members.sort((a, b) => (blockOrder.get(plan.ops[a].block) ?? 0) -
                           (blockOrder.get(plan.ops[b].block) ?? 0) || a - b);
    members.forEach((i, lane) => { pos[i] = {x: d * COL + PAD * 2, y: lane * ROW + PAD * 2}; });
  }
  return {index, pos};
}

function drawGraph(plan, host) {
  const started = performance.now();
  const {index, pos} = layout(plan);
  const width = Math.max(...pos.map((p) => p.x)) + NODE_W + PAD * 3;
  const height = Math.max(...pos.map((p) => p.y)) + NODE_H + PAD * 3;
  const root = svg("svg", {class: "plan", viewBox: `0 0 ${width} ${height}`,
                           preserveAspectRatio: "xMinYMin meet"});
  const groups = svg("g", {class: "blocks"}, root);
  const lines = svg("g", {class: "edges"}, root);
  const nodes = svg("g", {class: "ops"}, root);
  const blockOf = new Map(plan.blocks.map((b) => [b.id, b]));
  for (const block of plan.blocks) {
    const members = block.ops.map((id) => pos[index.get(id)]).filter(Boolean);
    if (!members.length) continue;
    const x0 = Math.min(...members.map((p) => p.x)) - PAD, y0 = Math.min(...members.map((p) => p.y)) - PAD;
    const x1 = Math.max(...members.map((p) => p.x)) + NODE_W + PAD;
    const y1 = Math.max(...members.map((p) => p.y)) + NODE_H + PAD;
    const rect = svg("rect", {x: x0, y: y0, width: x1 - x0, height: y1 - y0, rx: 6,
                              fill: MAPPING_COLOURS[block.mapping] || "#999",
                              class: block.view ? "block view" : "block", "data-block": block.id},
                     groups);
    svg("title", {}, rect).textContent =
      `${block.id} ${block.name}: ${block.mapping}${block.anchor ? `, anchor ${block.anchor}` : ""}` +
      `${block.view ? " (view)" : ""}, ${block.ops.length} ops`;
  }
  for (const e of plan.edges) {
    const a = pos[index.get(e.from)], b = pos[index.get(e.to)];
    if (!a || !b) continue;
    svg("line", {x1: a.x + NODE_W, y1: a.y + NODE_H / 2, x2: b.x, y2: b.y + NODE_H / 2,
                 class: e.internal ? "edge internal" : "edge"}, lines);
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
  // Show the whole height of the graph, and as many columns as the panel's shape allows.
  // A small graph is shown at its own size, never blown up.
  const aspect = host.clientWidth / Math.max(host.clientHeight, 1);
  v.x = 0; v.y = 0; v.h = v.full.h; v.w = Math.min(v.full.w, v.full.h * aspect);
  if (v.w < v.full.w && v.full.w / v.full.h < 8 * aspect) { v.w = v.full.w; v.h = v.w / aspect; }
  if (v.w < host.clientWidth) { v.w = host.clientWidth; v.h = host.clientHeight; }
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
