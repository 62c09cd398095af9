/* The chat page: conversations from the app's JSON API, replies streamed over fetch.
 *
 * A reply arrives as newline-delimited JSON read from a ReadableStream; Stop aborts the
 * fetch, which closes the connection the app holds to the model server, so the engine
 * drops the request. Editing a sent message or regenerating a reply keeps the old line as
 * a branch (the ‹ n/m › arrows switch). Model text is rendered by markdown.js (DOM nodes,
 * textContent only); no inline script or handler anywhere, so a strict CSP holds.
 */
"use strict";

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
  const bar = last.querySelector(".actions") || addActions(last, "assistant");
  const btn = button("regen", "↻ Regenerate", "Another reply (this one is kept as a branch)");
  bar.appendChild(btn);
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.querySelectorAll(".actions button").forEach((b) => { b.disabled = busy; });
}

async function streamReply(extra) {
  const s = settings();
  const row = addBubble("assistant", s.play ? s.play.assistant : null);
  row.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  markLastRegenerable();
  let text = "", meta = null, pending = false, pieces = 0, first = 0, stored = false;
  const paint = () => {
    pending = false;
    renderAssistant(row, text, meta);
    if (state.controller === controller && pieces) {
      renderLive(row, pieces, (performance.now() - first) / 1000);
    }
    scrollDown();
  };
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
        if (event.type === "delta") {
          if (!pieces) first = performance.now();
          pieces += 1;
          text += event.text;
        } else if (event.type === "citations") meta = { citations: event.citations };
        else if (event.type === "tool_call" || event.type === "tool_result") {
          meta = meta || {};  // a call the app runs, then its result: shown in the bubble
          if (event.type === "tool_call") (meta.tool_calls = meta.tool_calls || []).push(event.call);
          else (meta.tool_results = meta.tool_results || []).push(event);
        }
        else if (event.type === "error") meta = { ...(meta || {}), error: event.message };
        else if (event.type === "done") {
          text = event.message.content;
          meta = event.message.meta;
          stored = true;
        }
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") meta = { ...(meta || {}), stopped: true, stats: {} };
    else meta = { ...(meta || {}), error: err.message };
  } finally {
    state.controller = null;
    paint();
    // Stored (its "done" came): draw the stored line, with message ids (for Edit) and branch
    // arrows; the row keeps .streaming until then, so nothing reads a page about to change.
    // A stopped reply is stored as the connection closes, a moment later: kept as drawn.
    if (stored) await redraw();
    row.classList.remove("streaming");
    if (row.isConnected) addActions(row, "assistant");
    setBusy(false);
    markLastRegenerable();
    loadConversations();
    updateMeter();
  }
}

async function send(event) {
  event.preventDefault();
  const content = $("input").value;
  if (!content.trim() || state.controller) return;
  if (!$("model").value) { status("No model to talk to: is the model server up?"); return; }
  if (!state.fits) { status("This message will not fit the model's context (see below)."); return; }
  status("");
  try {
    if (!state.conv) {  // a new chat: in the list at once, titled by its first words
      const conv = await api("/api/conversations", { method: "POST", body: JSON.stringify({
        title: content.trim().slice(0, 60) || "New chat",
        settings: $("system").value.trim() ? { system: $("system").value } : {} }) });
      state.conv = conv.id;
      // replaceState, not location.hash: a hashchange would reopen (and abort) the chat.
      history.replaceState(null, "", `#/c/${conv.id}`);
      showConversationActions();
      await loadConversations();
    }
    $("input").value = "";
    autosize();
    const s = settings();
    const attachments = state.attachments.map((a) => a.name);
    state.attachments = [];
    drawAttachments();
    addActions(renderUser(content, s.play ? s.play.user : null, { attachments }), "user");
    await streamReply({ content, attachments });
  } catch (err) { status(err.message); }
}

/* The open conversation's messages, drawn off-screen and swapped in at once. */
function drawMessages(conv) {
  const saved = conv.settings || {};
  const branches = new Map((conv.branches || []).map((b) => [b.position, b]));
  const box = document.createDocumentFragment();
  conv.messages.forEach((m, i) => {
    let row;
    if (m.role === "user") row = renderUser(m.content, saved.play ? saved.play.user : null, m.meta, box);
    else if (m.role === "assistant") {
      row = addBubble("assistant", m.meta.speaker, box);
      renderAssistant(row, m.content, m.meta);
    } else return;
    row.dataset.id = m.id;
    addActions(row, m.role, branches.get(i));
  });
  const list = $("messages");
  list.querySelectorAll(".message").forEach((n) => n.remove());
  list.appendChild(box);
  $("empty").hidden = conv.messages.length > 0;
  markLastRegenerable();
}

async function redraw() {
  if (!state.conv) return;
  try { drawMessages(await api(`/api/conversations/${state.conv}`)); } catch (err) { status(err.message); }
}

function clearMessages() {
  $("messages").querySelectorAll(".message").forEach((n) => n.remove());
  $("empty").hidden = false;
}

function showConversationActions() {
  $("conv-actions").hidden = !state.conv;
  if (!state.conv) return;
  $("export-md").href = `/api/conversations/${state.conv}/export?format=md`;
  $("export-json").href = `/api/conversations/${state.conv}/export?format=json`;
}

async function openConversation(id) {
  if (state.controller) state.controller.abort();
  clearMessages();
  status("");
  state.conv = id;
  $("system").value = "";
  if (id) {
    try {
      const conv = await api(`/api/conversations/${id}`);
      const saved = conv.settings || {};
      if (saved.model && state.models.some((m) => m.id === saved.model)) $("model").value = saved.model;
      onModelChange();
      if (saved.play) { $("play-user").value = saved.play.user; $("play-assistant").value = saved.play.assistant; }
      $("system").value = saved.system || "";
      drawMessages(conv);
      scrollDown();
    } catch (err) { status(err.message); state.conv = null; }
  }
  showConversationActions();
  loadConversations();
  updateMeter();
}

function route() {
  const m = location.hash.match(/^#\/c\/([0-9a-f]+)$/);
  openConversation(m ? m[1] : null);
}

const saveSystem = debounce(async () => {
  if (!state.conv) return;
  try {
    await api(`/api/conversations/${state.conv}`, {
      method: "PATCH", body: JSON.stringify({ system: $("system").value }) });
  } catch (err) { status(err.message); }
}, 400);

function toggle(buttonId, onOff) {
  const b = $(buttonId);
  const open = b.getAttribute("aria-expanded") !== "true";
  b.setAttribute("aria-expanded", String(open));
  onOff(open);
}

function cycleTheme() {
  const next = THEMES[(THEMES.indexOf(storedTheme()) + 1) % THEMES.length];
  try { localStorage.setItem(THEME_KEY, next); } catch (_) { /* private mode: this page only */ }
  applyTheme(next);
  showTheme(next);
}

function showTheme(theme) {
  $("theme").title = { auto: "Theme: as the system (click: dark)", dark: "Theme: dark (click: light)",
                       light: "Theme: light (click: as the system)" }[theme];
  $("theme").dataset.theme = theme;
}

async function init() {
  initSidebar();
  initComposer();
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => {
    closeDrawer();
    history.replaceState(null, "", location.pathname);
    route();
    $("input").focus();
  });
  $("model").addEventListener("change", onModelChange);
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = $("temperature").value;
  });
  $("messages").addEventListener("click", onMessageClick);
  $("system").addEventListener("input", saveSystem);
  $("system-toggle").addEventListener("click", () => toggle("system-toggle", (open) => {
    $("system-panel").hidden = !open;
    if (open) $("system").focus();
  }));
  $("settings-toggle").addEventListener("click", () => toggle("settings-toggle", (open) => {
    document.querySelector(".main").classList.toggle("show-settings", open);
  }));
  $("theme").addEventListener("click", cycleTheme);
  showTheme(storedTheme());
  window.addEventListener("hashchange", route);
  await loadModels();
  if (!location.hash) {
    const list = await loadConversations();
    if (list.length) { location.hash = `#/c/${list[0].id}`; return; }
  }
  route();
}

init();
