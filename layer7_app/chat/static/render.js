/* Drawing messages: bubbles, the stats line under a reply, citations, attachment chips, and
 * each message's actions (copy, edit, regenerate, branch arrows; app.js handles their
 * clicks through one listener on #messages).
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

/* el(tag, className, text) is markdown.js's. */
function button(className, text, title) {
  const b = el("button", className, text);
  b.type = "button";
  if (title) b.title = title;
  return b;
}

function addBubble(role, speaker, parent) {
  byId("empty").hidden = true;
  const row = el("div", `message ${role}`);
  row.append(el("div", "speaker", speaker || (role === "user" ? "You" : "Assistant")),
             el("div", "body"));
  (parent || byId("messages")).appendChild(row);
  return row;
}

function chips(names) {
  const box = el("div", "chips");
  names.forEach((n) => box.appendChild(el("span", "chip", `attached: ${n}`)));
  return box;
}

function renderUser(text, speaker, meta, parent) {
  const row = addBubble("user", speaker, parent);
  row.querySelector(".body").textContent = text;  // the user's text, shown as typed
  if (meta && meta.attachments && meta.attachments.length) row.appendChild(chips(meta.attachments));
  if (!parent) scrollDown();
  return row;
}

function renderAssistant(row, text, meta) {
  row.querySelector(".body").replaceChildren(window.renderMarkdown(text));
  row.querySelectorAll(".stats, .citations, .error, .live, .tool-calls").forEach((n) => n.remove());
  if (meta && meta.tool_calls && meta.tool_calls.length) {
    row.insertBefore(toolCalls(meta), row.querySelector(".body"));
  }
  row.dataset.text = text;
  if (meta && meta.error) row.appendChild(el("div", "error", meta.error));
  if (meta && meta.citations && meta.citations.length) row.appendChild(citations(meta.citations));
  if (meta && (meta.stats || meta.stopped)) {
    const stats = el("div", "stats", statsLine(meta));
    const s = meta.stats || {};
    row.classList.toggle("cut", s.finish_reason === "length");
    if (s.finish_reason === "length") {  // the reply did not end: it ran out of max_tokens
      if (stats.textContent) stats.append(" · ");
      stats.appendChild(el("span", "cut-mark",
                           `✂ cut at max tokens (${s.completion_tokens ?? "?"})`));
    }
    row.appendChild(stats);
  }
}

/* The live line while a reply streams: pieces so far and their rate. */
function renderLive(row, pieces, seconds) {
  let live = row.querySelector(".live");
  if (!live) { live = el("div", "live"); row.appendChild(live); }
  const rate = seconds > 0 && pieces > 1 ? ` · ${((pieces - 1) / seconds).toFixed(1)} tok/s` : "";
  live.textContent = `streaming · ${pieces} tokens${rate}`;
}

function toolCalls(meta) {
  // each call the model made (name and arguments) and the result the app fed back
  const box = el("div", "tool-calls");
  const results = meta.tool_results || [];
  meta.tool_calls.forEach((c) => {
    const item = el("div", "tool-call");
    const call = el("code", null, `${c.function.name}(${c.function.arguments})`);
    const found = results.find((r) => r.id === c.id);
    const result = el("code", "tool-result", found ? `→ ${found.content}` : "…");
    item.append("▸ ", call, " ", result);
    box.appendChild(item);
  });
  return box;
}

function citations(list) {
  const box = el("div", "citations");
  list.forEach((c, i) => {
    const item = el("details");
    item.append(el("summary", null, `[${i + 1}] ${c.source} · passage ${c.passage}`),
                el("p", null, `${c.excerpt}…`));
    box.appendChild(item);
  });
  return box;
}

/* The row's action buttons; `branch` = {position, count, live} when it is a branch point. */
function addActions(row, role, branch) {
  row.querySelectorAll(".actions").forEach((n) => n.remove());
  const bar = el("div", "actions");
  if (branch && branch.count > 1) {
    const nav = el("span", "branch-nav");
    const prev = button("branch-prev", "‹", "Previous branch");
    const next = button("branch-next", "›", "Next branch");
    prev.disabled = branch.live === 0;
    next.disabled = branch.live === branch.count - 1;
    nav.append(prev, el("span", "branch-count", `${branch.live + 1}/${branch.count}`), next);
    nav.dataset.position = branch.position;
    nav.dataset.live = branch.live;
    bar.appendChild(nav);
  }
  if (role === "user") bar.appendChild(button("edit", "✎ Edit", "Edit and send again (the old branch is kept)"));
  else bar.appendChild(button("copy-reply", "Copy", "Copy this reply"));
  row.appendChild(bar);
  return bar;
}
