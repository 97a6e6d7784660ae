// The console's shell: the API client (with the tab's token), the router and small helpers.
// Plain ES modules, no build step. Every value goes into the page as text (never as HTML).

const TOKEN_KEY = "chronomq.token";

export class ApiError extends Error {
  constructor(status, body) {
    super((body && body.message) || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

// ------------------------------------------------------------------ token

let tokenWaiters = null;

function askToken(message) {
  const dialog = document.getElementById("token-dialog");
  document.getElementById("token-error").textContent = message || "";
  if (tokenWaiters === null) {
    tokenWaiters = [];
    const input = document.getElementById("token-input");
    input.value = "";
    if (!dialog.open) dialog.showModal();
    input.focus();
  }
  return new Promise((resolve) => tokenWaiters.push(resolve));
}

function submitToken() {
  const input = document.getElementById("token-input");
  const value = input.value.trim();
  if (!value) {
    document.getElementById("token-error").textContent = "The token is empty.";
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, value);
  document.getElementById("token-dialog").close();
  document.getElementById("sign-out").hidden = false;
  const waiters = tokenWaiters || [];
  tokenWaiters = null;
  waiters.forEach((resolve) => resolve(value));
}

let authRequired = null;

async function needsToken() {
  if (authRequired === null) {
    try {
      const r = await fetch("/healthz", { cache: "no-store" });
      authRequired = Boolean((await r.json()).auth_required);
    } catch (e) {
      return false;
    }
  }
  return authRequired;
}

// ------------------------------------------------------------------ API

export async function api(path, { method = "GET", body = undefined } = {}) {
  for (let attempt = 0; attempt < 5; attempt++) {
    let token = sessionStorage.getItem(TOKEN_KEY);
    if (!token && (await needsToken())) token = await askToken();
    const headers = { Accept: "application/json" };
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const r = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
    let data = null;
    try {
      data = await r.json();
    } catch (e) {
      data = null;
    }
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      authRequired = true;
      await askToken(token ? "That token was refused." : "");
      continue;
    }
    if (!r.ok) throw new ApiError(r.status, data);
    return data;
  }
  throw new ApiError(401, { message: "no valid token" });
}

// ------------------------------------------------------------------ DOM helpers

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

// Replace an element's children (arrays flattened, strings as text).
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

function append(el, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  append(el, children);
  return el;
}

export function table(columns, rows, attrs = {}) {
  return h(
    "table",
    attrs,
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows),
  );
}

export function card(label, value, attrs = {}) {
  return h("div", { class: "card", ...attrs }, h("div", { class: "label" }, label), h("div", { class: "value" }, value));
}

export function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined) return "–";
  const a = Math.abs(ms);
  if (a < 1000) return `${Math.round(ms)} ms`;
  if (a < 60_000) return `${(ms / 1000).toFixed(1)} s`;
  if (a < 3_600_000) return `${(ms / 60_000).toFixed(1)} min`;
  if (a < 86_400_000) return `${(ms / 3_600_000).toFixed(1)} h`;
  return `${(ms / 86_400_000).toFixed(1)} d`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  const d = Math.floor(s / 86400);
  const hh = Math.floor((s % 86400) / 3600);
  const mm = Math.floor((s % 3600) / 60);
  const ss = s % 60;
  if (d) return `${d}d ${hh}h`;
  if (hh) return `${hh}h ${mm}m`;
  if (mm) return `${mm}m ${ss}s`;
  return `${ss}s`;
}

export function fmtTime(ms) {
  if (ms === null || ms === undefined) return "–";
  const d = new Date(ms);
  return d.toISOString().replace("T", " ").replace("Z", " UTC");
}

export function fmtWhen(ms) {
  if (ms === null || ms === undefined) return "–";
  const delta = ms - Date.now();
  const rel = delta >= 0 ? `in ${fmtMs(delta)}` : `${fmtMs(-delta)} ago`;
  return `${fmtTime(ms)} (${rel})`;
}

export function errorText(e) {
  if (e instanceof ApiError) {
    const b = e.body || {};
    return `${e.status} ${b.error || ""}: ${b.message || e.message}${b.field ? ` (field ${b.field})` : ""}`;
  }
  return String(e && e.message ? e.message : e);
}

export function confirmAction(text) {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-text").textContent = text;
  dialog.showModal();
  return new Promise((resolve) => {
    const ok = document.getElementById("confirm-ok");
    const cancel = document.getElementById("confirm-cancel");
    const done = (value) => {
      ok.removeEventListener("click", onOk);
      cancel.removeEventListener("click", onCancel);
      dialog.removeEventListener("cancel", onCancel);
      if (dialog.open) dialog.close();
      resolve(value);
    };
    const onOk = () => done(true);
    const onCancel = () => done(false);
    ok.addEventListener("click", onOk);
    cancel.addEventListener("click", onCancel);
    dialog.addEventListener("cancel", onCancel);
  });
}

export function setStatus(text, kind) {
  const el = document.getElementById("status");
  el.textContent = text;
  el.className = `status ${kind || ""}`;
}

// ------------------------------------------------------------------ views and polling

const VIEWS = {
  cluster: () => import("./view-cluster.js"),
  topics: () => import("./view-topics.js"),
  groups: () => import("./view-groups.js"),
  levels: () => import("./view-levels.js"),
  timers: () => import("./view-timers.js"),
  messages: () => import("./view-messages.js"),
};

let current = null; // { name, view, timer, generation }
let generation = 0;

async function tick(state) {
  if (state.generation !== generation) return;
  try {
    await state.view.refresh();
    setStatus(`updated ${new Date().toLocaleTimeString("en-GB")}`, "ok");
    const main = document.getElementById("view");
    if (state.generation === generation) main.dataset.loaded = state.name;
  } catch (e) {
    setStatus(`cannot reach this node: ${errorText(e)}`, "bad");
    if (state.view.failed) state.view.failed(e);
  }
  if (state.generation === generation && state.view.every) {
    state.timer = setTimeout(() => tick(state), state.view.every);
  }
}

async function route() {
  const name = (location.hash || "#cluster").slice(1).split("?")[0];
  const load = VIEWS[name] || VIEWS.cluster;
  const viewName = VIEWS[name] ? name : "cluster";
  if (current && current.timer) clearTimeout(current.timer);
  generation += 1;
  const main = document.getElementById("view");
  delete main.dataset.loaded;
  main.replaceChildren();
  for (const a of document.querySelectorAll("#nav a")) {
    a.classList.toggle("active", a.dataset.view === viewName);
  }
  const mod = await load();
  const view = mod.create(main);
  current = { name: viewName, view, timer: null, generation };
  document.title = `chronomq · ${view.title}`;
  await tick(current);
}

function start() {
  document.getElementById("token-ok").addEventListener("click", submitToken);
  document.getElementById("token-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter") submitToken();
  });
  document.getElementById("token-dialog").addEventListener("cancel", (e) => e.preventDefault());
  const signOut = document.getElementById("sign-out");
  signOut.hidden = !sessionStorage.getItem(TOKEN_KEY);
  signOut.addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    signOut.hidden = true;
    route();
  });
  window.addEventListener("hashchange", route);
  route();
}

start();
