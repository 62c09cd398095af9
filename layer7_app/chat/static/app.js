/* The chat page: conversations from the app's JSON API, replies streamed over fetch.
 *
 * A reply arrives as newline-delimited JSON read from a ReadableStream; Stop aborts the
 * fetch, which closes the connection the app holds to the model server, so the engine
 * drops the request. Model text is rendered by markdown.js (DOM nodes, textContent only).
 */
"use strict";

const $ = (id) => document.getElementById(id);
const state = { conv: null, controller: null, models: [] };

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

function settings() {
  const model = $("model").value;
  const play = !$("play-controls").hidden && $("play").checked
    ? { user: $("play-user").value.trim() || "HORATIO",
        assistant: $("play-assistant").value.trim() || "HAMLET" }
    : null;
  const seed = parseInt($("seed").value, 10);
  const tools = [["tool-calculator", "calculator"], ["tool-search", "search_documents"]]
    .filter(([id]) => $(id).checked).map(([, name]) => name);
  return { model, temperature: parseFloat($("temperature").value),
           max_tokens: parseInt($("max-tokens").value, 10) || 128, play,
           seed: Number.isNaN(seed) ? null : seed, tools,
           tool_choice: tools.length && $("tool-required").checked ? "required" : "auto" };
}

function isCourse(model) { return /course/i.test(model || ""); }

function onModelChange() { $("play-controls").hidden = !isCourse($("model").value); }

async function loadModels() {
  try {
    const { models } = await api("/api/models");
    state.models = models;
    const select = $("model");
    select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    const course = models.find((m) => isCourse(m.id));
    if (course) select.value = course.id;
    onModelChange();
  } catch (err) { status(`Cannot list models: ${err.message}`); }
}

function markLastRegenerable() {
  document.querySelectorAll(".regen").forEach((b) => b.remove());
  const rows = document.querySelectorAll(".message.assistant");
  const last = rows[rows.length - 1];
  if (!last || state.controller) return;
  const btn = document.createElement("button");
  btn.type = "button";
  btn.className = "regen";
  btn.textContent = "↻ Regenerate";
  btn.addEventListener("click", () => { last.remove(); streamReply({ regenerate: true }); });
  last.appendChild(btn);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("input").disabled = false;
}

async function streamReply(extra) {
  const s = settings();
  const row = addBubble("assistant", s.play ? s.play.assistant : null);
  row.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  markLastRegenerable();
  let text = "", meta = null, pending = false;
  const paint = () => { pending = false; renderAssistant(row, text, meta); scrollDown(); };
  try {
    const resp = await fetch(`/api/conversations/${state.conv}/reply`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...s, ...extra }), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(`${resp.status}: ${(await resp.json()).detail}`);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const event = JSON.parse(buffer.slice(0, nl));
        buffer = buffer.slice(nl + 1);
        if (event.type === "delta") text += event.text;
        else if (event.type === "citations") meta = { citations: event.citations };
        else if (event.type === "tool_call" || event.type === "tool_result") {
          meta = meta || {};  // a call the app runs, then its result: shown in the bubble
          if (event.type === "tool_call") (meta.tool_calls = meta.tool_calls || []).push(event.call);
          else (meta.tool_results = meta.tool_results || []).push(event);
        }
        else if (event.type === "error") meta = { ...(meta || {}), error: event.message };
        else if (event.type === "done") { text = event.message.content; meta = event.message.meta; }
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") meta = { ...(meta || {}), stopped: true, stats: {} };
    else meta = { ...(meta || {}), error: err.message };
  } finally {
    state.controller = null;
    row.classList.remove("streaming");
    paint();
    setBusy(false);
    markLastRegenerable();
    loadConversations();
  }
}

async function send(event) {
  event.preventDefault();
  const content = $("input").value;
  if (!content.trim() || state.controller) return;
  if (!$("model").value) { status("No model to talk to: is the model server up?"); return; }
  try {
    if (!state.conv) {
      const conv = await api("/api/conversations", { method: "POST", body: "{}" });
      state.conv = conv.id;
      // replaceState, not location.hash: a hashchange would reopen (and abort) the chat.
      history.replaceState(null, "", `#/c/${conv.id}`);
    }
    $("input").value = "";
    autosize();
    const s = settings();
    renderUser(content, s.play ? s.play.user : null);
    await streamReply({ content });
  } catch (err) { status(err.message); }
}

async function loadConversations() {
  const list = await api("/api/conversations").catch(() => []);
  const nav = $("conversations");
  nav.replaceChildren(...list.map((c) => {
    const item = document.createElement("div");
    item.className = `conversation${c.id === state.conv ? " active" : ""}`;
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.title = c.title;
    open.addEventListener("click", () => { location.hash = `#/c/${c.id}`; });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.title = "Delete this chat";
    del.addEventListener("click", async () => {
      await api(`/api/conversations/${c.id}`, { method: "DELETE" }).catch(() => null);
      if (c.id === state.conv) location.hash = "";
      loadConversations();
    });
    item.append(open, del);
    return item;
  }));
  nav.dataset.loaded = "1";  // tests wait for this before counting
  return list;
}

function clearMessages() {
  $("messages").querySelectorAll(".message").forEach((n) => n.remove());
  $("empty").hidden = false;
}

async function openConversation(id) {
  if (state.controller) state.controller.abort();
  clearMessages();
  state.conv = id;
  if (!id) { loadConversations(); return; }
  try {
    const conv = await api(`/api/conversations/${id}`);
    const saved = conv.settings || {};
    if (saved.model && state.models.some((m) => m.id === saved.model)) $("model").value = saved.model;
    onModelChange();
    if (saved.play) { $("play-user").value = saved.play.user; $("play-assistant").value = saved.play.assistant; }
    for (const m of conv.messages) {
      if (m.role === "user") renderUser(m.content, saved.play ? saved.play.user : null);
      else if (m.role === "assistant") {
        renderAssistant(addBubble("assistant", m.meta.speaker), m.content, m.meta);
      }
    }
    markLastRegenerable();
    scrollDown();
  } catch (err) { status(err.message); state.conv = null; }
  loadConversations();
}

function route() {
  const m = location.hash.match(/^#\/c\/([0-9a-f]+)$/);
  openConversation(m ? m[1] : null);
}

function autosize() {
  const t = $("input");
  t.style.height = "auto";
  t.style.height = `${Math.min(t.scrollHeight, 200)}px`;
}

async function init() {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => { location.hash = ""; route(); $("input").focus(); });
  $("model").addEventListener("change", onModelChange);
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = $("temperature").value;
  });
  $("input").addEventListener("input", autosize);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  window.addEventListener("hashchange", route);
  await loadModels();
  if (!location.hash) {
    const list = await loadConversations();
    if (list.length) { location.hash = `#/c/${list[0].id}`; return; }
  }
  route();
}

init();
