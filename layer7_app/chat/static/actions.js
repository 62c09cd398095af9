/* What a message's buttons do (one listener on #messages, see onMessageClick): edit a sent
 * message and send it again (the server keeps the old line as a branch), copy a reply, and
 * step between branches. Replies are streamed by app.js's streamReply. */
"use strict";

function startEdit(row) {
  if (row.querySelector(".edit-box")) return;
  const body = row.querySelector(".body");
  const box = el("div", "edit-box");
  const area = el("textarea");
  area.value = body.textContent;
  const save = button("save-edit send", "Send edited");
  const cancel = button("cancel-edit tool", "Cancel");
  const buttons = el("div", "row");
  buttons.append(cancel, save);
  box.append(area, buttons);
  body.hidden = true;
  row.insertBefore(box, body.nextSibling);
  area.focus();
  cancel.addEventListener("click", () => { box.remove(); body.hidden = false; });
  save.addEventListener("click", async () => {
    const content = area.value;
    if (!content.trim() || state.controller) return;
    const editId = await messageId(row);
    if (editId === null) return;
    let next = row.nextElementSibling;  // the old line from here on is kept as a branch
    while (next) { const after = next.nextElementSibling; next.remove(); next = after; }
    box.remove();
    body.hidden = false;
    body.textContent = content;
    await streamReply({ content, edit_id: editId });
  });
}

/* A drawn row's stored id (a stopped reply's line is drawn before the store has it all). */
async function messageId(row) {
  if (row.dataset.id) return Number(row.dataset.id);
  const at = [...document.querySelectorAll("#messages .message")].indexOf(row);
  try {
    const conv = await api(`/api/conversations/${state.conv}`);
    return conv.messages[at] ? conv.messages[at].id : null;
  } catch (err) { status(err.message); return null; }
}

async function copyReply(row, btn) {
  const text = row.dataset.text || row.querySelector(".body").innerText;
  try {
    await navigator.clipboard.writeText(text);
  } catch (_) {  // no clipboard API (plain http on another host): the old way
    const area = el("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  btn.textContent = "✓ Copied";
  setTimeout(() => { btn.textContent = "Copy"; }, 1500);
}

async function chooseBranch(nav, step) {
  const position = Number(nav.dataset.position);
  const variant = Number(nav.dataset.live) + step;
  try {
    await api(`/api/conversations/${state.conv}/branches`, {
      method: "POST", body: JSON.stringify({ position, variant }) });
    await redraw();
  } catch (err) { status(err.message); }
}

function onMessageClick(e) {
  const btn = e.target.closest("button");
  const row = btn && btn.closest(".message");
  if (!row || state.controller) return;
  if (btn.classList.contains("copy-reply")) copyReply(row, btn);
  else if (btn.classList.contains("edit")) startEdit(row);
  else if (btn.classList.contains("regen")) { row.remove(); streamReply({ regenerate: true }); }
  else if (btn.classList.contains("branch-prev")) chooseBranch(btn.parentElement, -1);
  else if (btn.classList.contains("branch-next")) chooseBranch(btn.parentElement, 1);
}
