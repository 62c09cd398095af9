/* The conversation list: open, delete (after a confirm), search, import; a drawer on phones. */
"use strict";

function conversationItem(c, snippet) {
  const item = document.createElement("div");
  item.className = `conversation${c.id === state.conv ? " active" : ""}`;
  item.dataset.id = c.id;
  const open = document.createElement("button");
  open.type = "button";
  open.className = "open";
  open.textContent = c.title;
  open.title = c.title;
  if (snippet) {
    const s = document.createElement("span");
    s.className = "snippet";
    s.textContent = snippet;
    open.appendChild(s);
  }
  open.addEventListener("click", () => { closeDrawer(); location.hash = `#/c/${c.id}`; });
  const del = document.createElement("button");
  del.type = "button";
  del.className = "delete";
  del.textContent = "×";
  del.title = "Delete this chat";
  del.setAttribute("aria-label", `Delete “${c.title}”`);
  del.addEventListener("click", async () => {
    if (!window.confirm(`Delete “${c.title}”? This cannot be undone.`)) return;
    try {
      await api(`/api/conversations/${c.id}`, { method: "DELETE" });
    } catch (err) { status(err.message); return; }
    if (c.id === state.conv) { history.replaceState(null, "", location.pathname); route(); }
    else loadConversations();
  });
  item.append(open, del);
  return item;
}

/* Lists are fetched from many places at once (a reply ends, a chat opens, a search is typed):
   only the latest request draws, so a slow older answer never replaces a newer list. */
let listRequests = 0;

async function loadConversations() {
  const query = $("search").value.trim();
  const nav = $("conversations");
  const request = ++listRequests;
  let list;
  if (query) {
    list = await api(`/api/search?q=${encodeURIComponent(query)}`).catch(() => []);
    if (request !== listRequests) return list;
    nav.replaceChildren(...list.map((c) => conversationItem(c, c.snippet)));
    if (!list.length) {
      const none = document.createElement("div");
      none.className = "no-results";
      none.textContent = `No chat mentions “${query}”.`;
      nav.appendChild(none);
    }
  } else {
    list = await api("/api/conversations").catch(() => []);
    if (request !== listRequests) return list;
    nav.replaceChildren(...list.map((c) => conversationItem(c)));
  }
  nav.dataset.loaded = "1";  // tests wait for this before counting
  return list;
}

async function importFile(file) {
  try {
    const data = JSON.parse(await file.text());
    const conv = await api("/api/conversations/import", { method: "POST", body: JSON.stringify(data) });
    $("search").value = "";
    closeDrawer();
    location.hash = `#/c/${conv.id}`;
  } catch (err) {
    status(`Import failed: ${err instanceof SyntaxError ? "not a JSON file" : err.message}`);
  }
}

function initSidebar() {
  $("search").addEventListener("input", debounce(loadConversations, 200));
  $("import-file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    e.target.value = "";
    if (file) importFile(file);
  });
  $("menu").addEventListener("click", () => document.body.classList.add("drawer-open"));
  $("close-drawer").addEventListener("click", closeDrawer);
  $("scrim").addEventListener("click", closeDrawer);
}
