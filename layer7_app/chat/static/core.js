/* What every part of the page shares: its state, the JSON API, the status line, the
 * settings the toolbar holds. */
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  conv: null,          // the open conversation's id
  controller: null,    // the streaming reply's AbortController
  models: [],
  attachments: [],     // files attached to the next question: [{name, passages}]
  fits: true,          // the context meter's verdict on the draft
};

async function api(path, options = {}) {
  const resp = await fetch(path, {
    headers: { "Content-Type": "application/json" }, credentials: "same-origin", ...options,
  });
  if (!resp.ok) {
    let detail = resp.statusText;
    try { detail = (await resp.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${resp.status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`);
  }
  return resp.json();
}

function status(text) { $("status").textContent = text || ""; }

function isCourse(model) { return /course/i.test(model || ""); }

function playSettings() {
  return !$("play-controls").hidden && $("play").checked
    ? { user: $("play-user").value.trim() || "HORATIO",
        assistant: $("play-assistant").value.trim() || "HAMLET" }
    : null;
}

function settings() {
  const seed = parseInt($("seed").value, 10);
  const tools = [["tool-calculator", "calculator"], ["tool-search", "search_documents"]]
    .filter(([id]) => $(id).checked).map(([, name]) => name);
  return { model: $("model").value, temperature: parseFloat($("temperature").value),
           max_tokens: parseInt($("max-tokens").value, 10) || 128, play: playSettings(),
           seed: Number.isNaN(seed) ? null : seed, tools,
           tool_choice: tools.length && $("tool-required").checked ? "required" : "auto" };
}

function debounce(fn, ms) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

function closeDrawer() { document.body.classList.remove("drawer-open"); }
