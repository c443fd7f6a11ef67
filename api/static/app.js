// horizon-ray dashboard: nodes and their RAM ledger, the queue, jobs, a form that uploads a dataset, plans and
// submits a job, and one job's live loss curve (and a DPO job's reward curves), events and outputs (downloaded
// with the key).
// Plain JS, no dependencies. The API key lives in localStorage and goes out as a bearer token; data is
// always rendered with textContent, never as HTML.
"use strict";

const KEY_STORAGE = "horizon.apiKey";
const REFRESH_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
// a DPO job's metrics (TRL's names, as in its metrics events' `preference` and eval events' `eval_preference`),
// each with the id of its line in the reward chart
const REWARDS = [["rewards/chosen", "reward-chosen-line"], ["rewards/rejected", "reward-rejected-line"],
  ["rewards/margins", "reward-margins-line"], ["rewards/accuracies", "reward-accuracies-line"]];

const state = {
  key: localStorage.getItem(KEY_STORAGE) || "",
  selected: null,       // job id shown in the job panel
  stream: null,         // AbortController of the selected job's event stream
  loss: [],             // [step, loss] of the selected job
  evalLoss: [],         // [step, eval_loss]
  rewards: {},          // TRL name -> [step, value] of a DPO job's training steps
  outputsOf: null,      // "<job id>:<status>:<step>" the outputs table was listed at
  timer: null,
};

// ---- small helpers -----------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = Number(n);
  while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i++; }
  return `${x.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

function num(x, digits = 4) {
  return typeof x === "number" && isFinite(x) ? Number(x.toPrecision(digits)).toString() : "–";
}

// "step 21/400: loss 1.975, 7,685 tokens/s, ETA 48 s": a step's place in the run, throughput and time left
function progressLine(d) {
  const parts = [`step ${d.step}${d.total_steps ? `/${d.total_steps}` : ""}: loss ${num(d.loss)}`];
  const rewards = rewardsLine(d.preference);
  if (rewards) parts.push(rewards);
  if (typeof d.tokens_per_s === "number") parts.push(`${Math.round(d.tokens_per_s).toLocaleString("en-US")} tokens/s`);
  if (typeof d.eta_s === "number") parts.push(`ETA ${duration(d.eta_s)}`);
  return parts.join(", ");
}

// "reward accuracy 87.5 %, margin 0.412" of a DPO step or evaluation, as `horizon-ray status` words it; else ""
function rewardsLine(p) {
  if (!p || typeof p["rewards/accuracies"] !== "number") return "";
  const margin = typeof p["rewards/margins"] === "number" ? `, margin ${num(p["rewards/margins"])}` : "";
  return `reward accuracy ${(100 * p["rewards/accuracies"]).toFixed(1)} %${margin}`;
}

function duration(s) {
  if (typeof s !== "number" || !isFinite(s)) return "–";
  if (s < 90) return `${Math.round(s)} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function when(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "–";
}

function badge(status) {
  return el("span", { class: `badge status-${status}` }, status);
}

function banner(text) {
  const b = document.getElementById("banner");
  b.textContent = text || "";
  b.hidden = !text;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function headers(extra) {
  const h = Object.assign({ Accept: "application/json" }, extra || {});
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

async function api(path, options = {}) {
  const res = await fetch(path, Object.assign({}, options, { headers: headers(options.headers) }));
  const text = await res.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = text; }
  if (!res.ok) {
    const err = new Error(body && body.error ? `${body.error.code}: ${body.error.message}` : res.statusText);
    err.status = res.status;
    throw err;
  }
  return body;
}

// ---- periodic refresh: nodes, queue, jobs ------------------------------------------------------------

async function refresh() {
  if (!state.key) {
    banner("Enter an API key to see your jobs.");
    return;
  }
  try {
    const [nodes, queue, jobs] = await Promise.all([api("/nodes"), api("/queue"), api("/finetune?limit=50")]);
    banner("");
    renderNodes(nodes.data);
    renderQueue(queue);
    renderJobs(jobs.data);
    if (state.selected) {
      const job = jobs.data.find((j) => j.id === state.selected) || (await api(`/finetune/${state.selected}`));
      renderJobFacts(job);
    }
  } catch (err) {
    banner(err.status === 401 ? "The API key was refused; enter a valid key." : `Cannot reach the API: ${err.message}`);
  }
}

function renderNodes(nodes) {
  const body = document.querySelector("#nodes tbody");
  const totalFree = nodes.filter((n) => n.alive).reduce((a, n) => a + n.free_bytes, 0);
  document.getElementById("nodes-summary").textContent =
    `${nodes.length} node(s), ${bytes(totalFree)} free`;
  body.replaceChildren(...nodes.map((n) => {
    const bar = el("div", { class: "bar", title: "RAM ledger: yours (blue), other tenants (grey), free" });
    for (const r of n.ledger) {
      const pct = n.ram_bytes ? (100 * r.host_bytes) / n.ram_bytes : 0;
      const seg = el("span", { class: r.mine ? "mine" : "other", title: `${r.job_id || "other tenant"}: ${bytes(r.host_bytes)}` });
      seg.style.width = `${Math.min(100, pct)}%`;
      bar.append(seg);
    }
    const gpus = n.gpu_count ? `${n.gpu_count} × ${bytes(n.gpu_memory_bytes)}` : "none";
    return el("tr", { dataset: { nodeId: n.node_id } },
      el("td", { class: "id" }, n.node_id),
      el("td", {}, n.alive ? "alive" : "lost"),
      el("td", {}, bar),
      el("td", {}, bytes(n.reserved_bytes)),
      el("td", {}, bytes(n.free_bytes)),
      el("td", {}, bytes(n.ram_bytes)),
      el("td", {}, gpus),
      el("td", {}, n.ledger.map((r) => r.job_id || "·").join(" ")));
  }));
}

function renderQueue(queue) {
  document.getElementById("queue-summary").textContent =
    `${queue.data.length} of yours waiting, ${queue.total_waiting} in all`;
  document.querySelector("#queue tbody").replaceChildren(...queue.data.map((q) =>
    el("tr", { dataset: { jobId: q.id } },
      el("td", {}, q.position ?? "–"),
      el("td", { class: "id" }, q.name ? `${q.id} (${q.name})` : q.id),
      el("td", {}, badge(q.status)),
      el("td", {}, q.reason || ""))));
}

function renderJobs(jobs) {
  document.getElementById("jobs-summary").textContent = `${jobs.length} shown`;
  document.querySelector("#jobs tbody").replaceChildren(...jobs.map((j) => {
    const p = j.progress;
    const bar = el("div", { class: "bar" });
    const fill = el("span", { class: "fill" });
    fill.style.width = `${Math.round(100 * (j.status === "succeeded" ? 1 : p.fraction || 0))}%`;
    bar.append(fill);
    const cancel = TERMINAL.has(j.status) || j.status === "cancelling" ? "" :
      el("button", { type: "button", class: "cancel", onclick: (e) => { e.stopPropagation(); cancelJob(j.id); } }, "cancel");
    return el("tr", {
      class: `selectable${j.id === state.selected ? " selected" : ""}`,
      dataset: { jobId: j.id, status: j.status },
      onclick: () => select(j.id),
    },
      el("td", { class: "id" }, j.id),
      el("td", {}, j.name || ""),
      el("td", { class: "status" }, badge(j.status)),
      el("td", { class: "progress" }, el("div", { class: "progress-cell" }, bar,
        el("span", { class: "muted" }, `${p.step}/${p.total_steps ?? "?"}`))),
      el("td", { class: "loss" }, num(j.metrics.loss)),
      el("td", {}, num(p.tokens_per_s, 3)),
      el("td", {}, TERMINAL.has(j.status) ? "–" : duration(p.eta_s)),
      el("td", { class: "id" }, j.node_id || "–"),
      el("td", {}, when(j.created_at)),
      el("td", {}, cancel));
  }));
}

async function cancelJob(id) {
  try { await api(`/finetune/${id}/cancel`, { method: "POST" }); } catch (err) { banner(err.message); }
  refresh();
}

// ---- the selected job: facts, events over SSE, loss curve --------------------------------------------

function select(id) {
  if (state.stream) state.stream.abort();
  state.selected = id;
  state.loss = [];
  state.evalLoss = [];
  state.rewards = {};
  state.outputsOf = null;
  document.querySelector("#outputs tbody").replaceChildren();
  document.getElementById("job-section").hidden = false;
  document.getElementById("job-title").textContent = id;
  document.getElementById("events").replaceChildren();
  for (const tr of document.querySelectorAll("#jobs tbody tr")) tr.classList.toggle("selected", tr.dataset.jobId === id);
  drawCharts();
  api(`/finetune/${id}`).then(renderJobFacts).catch((err) => banner(err.message));
  follow(id);
}

// what the job trains: full, or LoRA with its rank and the base's quantization (QLoRA: nf4)
function methodText(spec) {
  if (!spec || spec.method !== "lora") return (spec && spec.method) || "full";
  const lora = spec.lora || {};
  const q = lora.quantize && lora.quantize !== "none" ? `, ${lora.quantize} base` : "";
  return `lora r${lora.r ?? 8}${q}`;
}

// a DPO job's objective: its loss and beta
function dpoText(dpo) {
  return `dpo ${(dpo && dpo.loss) || "sigmoid"}, beta ${(dpo && dpo.beta) ?? 0.1}`;
}

// [TRL name, value] facts of a DPO job's latest training (prefix "") or eval ("eval ") metrics; none for SFT
function rewardFacts(p, prefix) {
  if (!p) return [];
  const facts = REWARDS.map(([name]) => [`${prefix}${name}`, num(p[name])]);
  const acc = p["rewards/accuracies"];
  if (typeof acc === "number") facts[3][1] = `${(100 * acc).toFixed(1)} %`;
  return facts;
}

function renderJobFacts(job) {
  if (job.id !== state.selected) return;
  const status = document.getElementById("job-status");
  status.replaceWith(Object.assign(badge(job.status), { id: "job-status" }));
  const facts = [
    ["status", job.status], ["method", methodText(job.spec)],
    ...(job.spec && job.spec.objective === "dpo" ? [["objective", dpoText(job.spec.dpo)]] : []),
    ["node", job.node_id || "–"],
    ["step", `${job.progress.step} / ${job.progress.total_steps ?? "?"}`],
    ["tokens/s", num(job.progress.tokens_per_s, 3)], ["ETA", duration(job.progress.eta_s)],
    ["loss", num(job.metrics.loss)],
    ...rewardFacts(job.metrics.preference, ""), ...rewardFacts(job.metrics.eval_preference, "eval "),
    ["host RAM (plan)", bytes(job.plan && job.plan.host_bytes)],
    ["created", when(job.created_at)], ["started", when(job.started_at)], ["finished", when(job.finished_at)],
    ["queue", job.queue ? `#${job.queue.position ?? "?"} ${job.queue.reason || ""}` : "–"],
    ["error", job.error ? `${job.error.code}: ${job.error.message}` : "–"],
  ];
  document.getElementById("job-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  document.getElementById("download-final").hidden = job.status !== "succeeded";
  if (state.outputsOf !== `${job.id}:${job.status}:${job.progress.step}`) {  // list again when the job moved
    state.outputsOf = `${job.id}:${job.status}:${job.progress.step}`;
    api(`/finetune/${encodeURIComponent(job.id)}/outputs`).then((o) => renderOutputs(job.id, o.data)).catch(() => {});
  }
  showTryBox(job);
}

// ---- "try it": chat with a succeeded job's model through /v1/chat/completions, streamed ------------

async function showTryBox(job) {
  const box = document.getElementById("try-box");
  box.hidden = job.status !== "succeeded";
  if (box.hidden || box.dataset.jobId === job.id) return;
  box.dataset.jobId = job.id;
  document.getElementById("try-output").textContent = "";
  try {
    const ft = await api(`/v1/fine_tuning/jobs/${encodeURIComponent(job.id)}`);
    box.dataset.model = ft.fine_tuned_model || "";
    document.getElementById("try-model").textContent = box.dataset.model;
  } catch (err) {
    box.hidden = true;  // the OpenAI-compatible API is off: nothing serves the model
  }
}

async function tryModel() {
  const box = document.getElementById("try-box");
  const out = document.getElementById("try-output");
  const content = document.getElementById("try-input").value.trim();
  if (!content || !box.dataset.model) return;
  out.textContent = "";
  out.dataset.state = "running";
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
      body: JSON.stringify({ model: box.dataset.model, messages: [{ role: "user", content }], max_tokens: 128,
        temperature: 0, stream: true }),
    });
    if (!res.ok) {
      const body = await res.json().catch(() => null);
      throw new Error(body && body.error ? body.error.message : `HTTP ${res.status}`);
    }
    for await (const msg of sseMessages(res)) {  // the closing "data: [DONE]" is no JSON: parseSse drops it
      for (const c of msg.data.choices || []) if (c.delta && c.delta.content) out.textContent += c.delta.content;
    }
    out.dataset.state = "done";
  } catch (err) {
    out.textContent = err.message;
    out.dataset.state = "error";
  }
}

// ---- outputs: listed with their sizes, downloaded with the key (a plain link would carry no Bearer header) --

function renderOutputs(id, files) {
  if (id !== state.selected) return;
  const base = `/finetune/${encodeURIComponent(id)}/outputs`;
  document.querySelector("#outputs tbody").replaceChildren(...files.map((f) =>
    el("tr", { dataset: { path: f.path } },
      el("td", { class: "id" }, f.path),
      el("td", {}, bytes(f.bytes)),
      el("td", {}, el("button", { type: "button", class: "download",
        onclick: () => download(`${base}/${f.path.split("/").map(encodeURIComponent).join("/")}`,
                                f.path.split("/").pop()) }, "download")))));
}

async function download(path, filename) {
  try {
    const res = await fetch(path, { headers: headers({ Accept: "*/*" }) });
    if (!res.ok) throw new Error(`${filename}: HTTP ${res.status}`);
    const url = URL.createObjectURL(await res.blob());
    const a = el("a", { href: url, download: filename, hidden: true });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
    document.getElementById("form-result").textContent = `downloaded ${filename}`;
  } catch (err) {
    banner(err.message);
  }
}

async function follow(id) {
  const ctrl = new AbortController();
  state.stream = ctrl;
  let after = 0;
  while (!ctrl.signal.aborted && state.selected === id) {
    try {
      const res = await fetch(`/finetune/${encodeURIComponent(id)}/events?after=${after}`,
        { headers: headers({ Accept: "text/event-stream" }), signal: ctrl.signal });
      if (!res.ok) { banner(`events: HTTP ${res.status}`); return; }
      for await (const msg of sseMessages(res)) {
        if (msg.id) after = Number(msg.id);
        if (msg.event === "end") { refresh(); return; }
        onEvent(msg.event, msg.data);
      }
    } catch (err) {
      if (ctrl.signal.aborted) return;
    }
    await sleep(2000);  // the stream broke off: resume after the last event seen
  }
}

// the server-sent events of a response as they arrive (each block up to a blank line), parsed by parseSse
async function* sseMessages(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const msg = parseSse(buffer.slice(0, cut));
      buffer = buffer.slice(cut + 2);
      if (msg) yield msg;
    }
  }
}

function parseSse(block) {
  let event = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "id") id = value;
    else if (field === "data") data.push(value);
  }
  if (!data.length) return null;
  try { return { event, id, data: JSON.parse(data.join("\n")) }; } catch (_) { return null; }
}

function onEvent(type, ev) {
  const d = ev.data || {};
  if (type === "metrics") {
    if (typeof d.loss === "number" && typeof d.step === "number") addPoint(state.loss, d.step, d.loss);
    if (typeof d.eval_loss === "number" && typeof d.step === "number") addPoint(state.evalLoss, d.step, d.eval_loss);
    if (d.preference && typeof d.step === "number") {
      for (const [name] of REWARDS) {
        if (typeof d.preference[name] === "number") addPoint(state.rewards[name] ||= [], d.step, d.preference[name]);
      }
    }
    drawCharts();
  }
  let summary = "";
  if (type === "status") summary = `${d.from || ""} → ${d.to || ""}${d.reason ? ` (${d.reason})` : ""}`;
  else if (type === "metrics" && "eval_loss" in d) {
    const rewards = rewardsLine(d.eval_preference);
    summary = `step ${d.step}: eval loss ${num(d.eval_loss)}${rewards ? `, ${rewards}` : ""}`;
  }
  else if (type === "metrics") summary = progressLine(d);
  else if (type === "checkpoint") summary = `step ${d.step}`;
  else if (type === "memory") summary = `host memory ${bytes(d.rss_bytes)} now, peak ${bytes(d.peak_rss_bytes)}, ${bytes(d.planned_bytes)} planned`;
  else if (type === "error") summary = `${d.code || ""}: ${d.message || ""}`;
  const list = document.getElementById("events");
  list.append(el("li", { value: ev.seq, dataset: { type } }, `${type} ${summary}`));
  while (list.children.length > 300) list.firstChild.remove();
  list.scrollTop = list.scrollHeight;
  if (type === "status" && d.to) {
    const status = document.getElementById("job-status");
    status.replaceWith(Object.assign(badge(d.to), { id: "job-status" }));
  }
}

function addPoint(series, step, value) {
  const last = series[series.length - 1];
  if (last && last[0] === step) last[1] = value;
  else series.push([step, value]);
}

// the loss chart, and the reward chart of a DPO job (hidden for SFT)
function drawCharts() {
  drawChart("loss-chart", [[state.loss, "loss-line"], [state.evalLoss, "eval-line"]]);
  const lines = REWARDS.map(([name, id]) => [state.rewards[name] || [], id]);
  const rewards = document.getElementById("reward-section");
  rewards.hidden = !lines.some(([points]) => points.length);
  if (!rewards.hidden) drawChart("reward-chart", lines);
}

// `lines`: [[step, value] points, the id of its path]; ids give each line its style and the tests a handle
function drawChart(boxId, lines) {
  const box = document.getElementById(boxId);
  const W = Math.max(320, Math.round(box.clientWidth) || 640);
  const H = Math.max(160, Math.round(box.clientHeight) || 260);
  const pad = { l: 48, r: 12, t: 12, b: 28 };
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const all = lines.flatMap(([points]) => points);
  if (!all.length) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" });
    t.textContent = "no metrics yet";
    root.append(t);
    box.replaceChildren(root);
    return;
  }
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const yPad = 0.05 * (y1 - y0);
  y0 = y0 >= 0 ? Math.max(0, y0 - yPad) : y0 - yPad;  // a loss is never negative: keep its axis at >= 0
  y1 += yPad;
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (W - pad.l - pad.r);
  const sy = (y) => H - pad.b - ((y - y0) / (y1 - y0)) * (H - pad.t - pad.b);
  for (let i = 0; i <= 4; i++) {
    const y = y0 + ((y1 - y0) * i) / 4;
    root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: sy(y), y2: sy(y), class: "grid" }));
    const t = svg("text", { x: pad.l - 6, y: sy(y) + 3, "text-anchor": "end", class: "tick" });
    t.textContent = num(y, 3);
    root.append(t);
  }
  for (let i = 0; i <= 4; i++) {
    const x = x0 + ((x1 - x0) * i) / 4;
    const t = svg("text", { x: sx(x), y: H - 8, "text-anchor": "middle", class: "tick" });
    t.textContent = String(Math.round(x));
    root.append(t);
  }
  root.append(svg("line", { x1: pad.l, x2: pad.l, y1: pad.t, y2: H - pad.b, class: "axis" }));
  root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: H - pad.b, y2: H - pad.b, class: "axis" }));
  const line = (series, id) => {
    const d = series.map((p, i) => `${i ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    return svg("path", { id, d, "data-points": series.length });
  };
  for (const [points, id] of lines) if (points.length) root.append(line(points, id));
  box.replaceChildren(root);
}

// ---- key form, submit box, start -----------------------------------------------------------------------

function setKey(key) {
  state.key = key;
  if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  document.getElementById("whoami").textContent = key ? "key saved in this browser" : "";
  refresh();
  loadChoices();
}

async function sendSpec(path) {
  const out = document.getElementById("submit-result");
  try {
    const spec = JSON.parse(document.getElementById("spec-input").value || "{}");
    const body = await postJson(path, spec);
    if (path === "/plan") { out.textContent = ""; renderPlan(body); return; }
    out.textContent = `submitted ${body.id} (${body.status})`;
    await refresh();
    select(body.id);
  } catch (err) {
    out.textContent = err.message;
  }
}

function postJson(path, body) {
  return api(path, { method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" } });
}

// The planner's verdict in a few lines: where it goes and why, what it needs, each node's verdict.
function renderPlan(res) {
  const view = document.getElementById("plan-view");
  const p = res.plan || {};
  const words = { place: `runs now on node ${res.node_id}`, queue: `waits for node ${res.node_id || "a node"}`,
                  reject: "no node can ever hold it" };
  const needs = [`host RAM ${bytes(p.host_bytes)}`];
  if (p.gpu_bytes) needs.push(`GPU memory ${bytes(p.gpu_bytes)}`);
  if (typeof p.step_time_s === "number") needs.push(`~${num(p.step_time_s, 3)} s a step (${p.bound || "planned"})`);
  if (p.params) needs.push(`${Number(p.params).toLocaleString("en-US")} parameters, ${p.method || ""} ${p.mode || ""}`);
  view.replaceChildren(
    el("div", {}, el("span", { class: `verdict ${res.decision}`, id: "plan-verdict" }, words[res.decision] || res.decision),
      res.reason ? ` — ${res.reason}` : ""),
    el("div", { class: "muted" }, needs.join("; ")),
    el("ul", { id: "plan-nodes" }, ...(res.nodes || []).map((n) =>
      el("li", { dataset: { nodeId: n.node_id, fits: String(Boolean(n.fits)) } },
        `node ${n.node_id}: ${n.fits_now ? "fits now" : n.fits ? "fits, busy now" : "does not fit"} — ${n.reason || ""}`))));
  view.hidden = false;
}

function formSpec() {
  const value = (id) => document.getElementById(id).value;
  const spec = {
    model: { path: value("f-model") }, data: { path: value("f-data") }, method: value("f-method"),
    training: { max_steps: Number(value("f-max-steps")), lr: Number(value("f-lr")),
                seq_len: Number(value("f-seq-len")), micro_batch_size: Number(value("f-micro-batch")) },
  };
  if (value("f-name").trim()) spec.name = value("f-name").trim();
  return spec;
}

async function planForm() {
  const out = document.getElementById("form-result");
  out.textContent = "planning ...";
  try { renderPlan(await postJson("/plan", formSpec())); out.textContent = ""; } catch (err) { out.textContent = err.message; }
}

async function submitForm(e) {
  e.preventDefault();
  const out = document.getElementById("form-result");
  try {
    const job = await postJson("/finetune", formSpec());
    out.textContent = `submitted ${job.id} (${job.status})`;
    await refresh();
    select(job.id);
  } catch (err) {
    out.textContent = err.message;
  }
}

function fill(select, options, empty) {
  const keep = select.value;
  select.replaceChildren(...(options.length ? options.map(([v, label]) => el("option", { value: v }, label))
    : [el("option", { value: "" }, empty)]));
  if (options.some(([v]) => v === keep)) select.value = keep;
}

async function loadChoices() {
  if (!state.key) return;
  try {
    const [models, files] = await Promise.all([api("/v1/models"), api("/files")]);
    fill(document.getElementById("f-model"), models.data.map((m) => [m.id, m.id]),
         "no catalogue: the operator sets HORIZON_MODEL_CATALOGUE");
    fill(document.getElementById("f-data"), files.data.map((f) => [f.id, `${f.filename} (${f.id}, ${f.num_examples ?? "?"} examples)`]),
         "upload a dataset first");
  } catch (_) { /* the banner says why (refresh) */ }
}

async function upload(e) {
  e.preventDefault();
  const out = document.getElementById("upload-result");
  const file = document.getElementById("upload-file").files[0];
  if (!file) { out.textContent = "choose a file first"; return; }
  out.textContent = `uploading ${file.name} ...`;
  try {
    const meta = await api(`/files?filename=${encodeURIComponent(file.name)}`,
      { method: "POST", body: file, headers: { "Content-Type": "application/x-ndjson" } });
    out.textContent = `uploaded ${meta.id}: ${meta.num_examples} examples, ${meta.format}`;
    await loadChoices();
    document.getElementById("f-data").value = meta.id;
  } catch (err) {
    out.textContent = err.message;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const input = document.getElementById("api-key");
  input.value = state.key;
  document.getElementById("key-form").addEventListener("submit", (e) => { e.preventDefault(); setKey(input.value.trim()); });
  document.getElementById("forget-key").addEventListener("click", () => { input.value = ""; setKey(""); });
  document.getElementById("plan-button").addEventListener("click", () => sendSpec("/plan"));
  document.getElementById("submit-button").addEventListener("click", () => sendSpec("/finetune"));
  document.getElementById("try-button").addEventListener("click", tryModel);
  document.getElementById("upload-form").addEventListener("submit", upload);
  document.getElementById("job-form").addEventListener("submit", submitForm);
  document.getElementById("form-plan").addEventListener("click", planForm);
  document.getElementById("download-final").addEventListener("click", () => {
    if (state.selected) download(`/finetune/${encodeURIComponent(state.selected)}/outputs/final.tar`, `${state.selected}-final.tar`);
  });
  loadChoices();
  if (state.key) document.getElementById("whoami").textContent = "key saved in this browser";
  refresh();
  state.timer = setInterval(refresh, REFRESH_MS);
  window.addEventListener("resize", drawCharts);
});
