/* Drawing messages: bubbles, the stats line under a reply, citations.
 *
 * User text goes in with textContent; model text through renderMarkdown (markdown.js),
 * which only ever creates DOM nodes. Nothing here parses HTML.
 */
"use strict";

const byId = (id) => document.getElementById(id);

function scrollDown() { const m = byId("messages"); m.scrollTop = m.scrollHeight; }

function fmt(value, digits, unit) {
  return value === null || value === undefined ? "–" : `${Number(value).toFixed(digits)}${unit}`;
}

function statsLine(meta) {
  const s = (meta && meta.stats) || {};
  const has = (v) => v !== null && v !== undefined;
  const parts = [];
  if (has(s.ttft_s)) parts.push(`TTFT ${fmt(s.ttft_s * 1000, 0, " ms")}`);
  if (has(s.tokens_per_s)) parts.push(`${fmt(s.tokens_per_s, 1, "")} tok/s`);
  if (has(s.prompt_tokens)) {
    parts.push(`prefix cache ${s.cached_prompt_tokens ?? 0}/${s.prompt_tokens} prompt tokens`);
  }
  if (has(s.ttft_s)) {
    parts.push(`spec. acceptance ${has(s.spec_acceptance)
      ? fmt(s.spec_acceptance * 100, 0, "%") : "off"}`);
  }
  if (meta && meta.stopped) parts.push(`stopped${has(s.completion_tokens)
    ? ` after ${s.completion_tokens} tokens` : ""}`);
  return parts.join(" · ");
}

function addBubble(role, speaker) {
  byId("empty").hidden = true;
  const row = document.createElement("div");
  row.className = `message ${role}`;
  const who = document.createElement("div");
  who.className = "speaker";
  who.textContent = speaker || (role === "user" ? "You" : "Assistant");
  const body = document.createElement("div");
  body.className = "body";
  row.append(who, body);
  byId("messages").appendChild(row);
  return row;
}

function renderUser(text, speaker) {
  const row = addBubble("user", speaker);
  row.querySelector(".body").textContent = text;  // the user's text, shown as typed
  scrollDown();
}

function renderAssistant(row, text, meta) {
  row.querySelector(".body").replaceChildren(window.renderMarkdown(text));
  row.querySelectorAll(".stats, .citations, .error, .tool-calls").forEach((n) => n.remove());
  if (meta && meta.tool_calls && meta.tool_calls.length) row.insertBefore(toolCalls(meta), row.querySelector(".body"));
  if (meta && meta.error) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = meta.error;
    row.appendChild(err);
  }
  if (meta && meta.citations && meta.citations.length) row.appendChild(citations(meta.citations));
  if (meta && (meta.stats || meta.stopped)) {
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = statsLine(meta);
    row.appendChild(stats);
  }
}

function toolCalls(meta) {
  // each call the model made (name and arguments) and the result the app fed back
  const box = document.createElement("div");
  box.className = "tool-calls";
  const results = meta.tool_results || [];
  meta.tool_calls.forEach((c) => {
    const item = document.createElement("div");
    item.className = "tool-call";
    const call = document.createElement("code");
    call.textContent = `${c.function.name}(${c.function.arguments})`;
    const found = results.find((r) => r.id === c.id);
    const result = document.createElement("code");
    result.className = "tool-result";
    result.textContent = found ? `→ ${found.content}` : "…";
    item.append("🔧 ", call, " ", result);
    box.appendChild(item);
  });
  return box;
}

function citations(list) {
  const box = document.createElement("div");
  box.className = "citations";
  list.forEach((c, i) => {
    const item = document.createElement("details");
    const summary = document.createElement("summary");
    summary.textContent = `[${i + 1}] ${c.source} · passage ${c.passage}`;
    const excerpt = document.createElement("p");
    excerpt.textContent = `${c.excerpt}…`;
    item.append(summary, excerpt);
    box.appendChild(item);
  });
  return box;
}

