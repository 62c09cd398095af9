/* The composer: the context meter (the draft's prompt counted by the model's own tokenizer,
 * a moment after typing stops) and files attached to the question. */
"use strict";

let meterSeq = 0;

async function updateMeter() {
  const seq = ++meterSeq;
  const s = settings();
  const content = $("input").value;
  if (!s.model || (!content.trim() && !state.conv)) {
    $("meter").textContent = "";
    $("meter").classList.remove("over");
    state.fits = true;
    $("send").disabled = false;
    return;
  }
  const body = { model: s.model, content, max_tokens: s.max_tokens, play: s.play,
                 conversation: state.conv };
  if (!state.conv) body.system = $("system").value;
  let r;
  try {
    r = await api("/api/count", { method: "POST", body: JSON.stringify(body) });
  } catch (_) { return; }  // the meter is advice: a failed count leaves the last one
  if (seq !== meterSeq) return;  // a newer draft is being counted
  const meter = $("meter");
  const approx = r.estimated ? "~" : "";
  state.fits = r.fits;
  meter.classList.toggle("over", !r.fits);
  meter.dataset.tokens = r.prompt_tokens;
  if (!r.context_len) meter.textContent = `${approx}${r.prompt_tokens} prompt tokens`;
  else if (r.fits) {
    meter.textContent = `${approx}${r.prompt_tokens} + ${r.max_tokens} reply / ` +
      `${r.context_len} tokens of context`;
  } else {
    meter.textContent = `Will not fit: ${approx}${r.prompt_tokens} prompt tokens + ` +
      `${r.max_tokens} for the reply > ${r.context_len}-token context. Shorten it or lower Max tokens.`;
  }
  $("send").disabled = !r.fits;
}

const meterSoon = debounce(updateMeter, 250);

function drawAttachments() {
  const box = $("attached");
  box.hidden = !state.attachments.length;
  box.replaceChildren(...state.attachments.map((a, i) => {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.textContent = `${a.name} · ${a.passages} passage${a.passages === 1 ? "" : "s"}`;
    const drop = document.createElement("button");
    drop.type = "button";
    drop.textContent = "×";
    drop.title = "Do not attach";
    drop.addEventListener("click", () => { state.attachments.splice(i, 1); drawAttachments(); });
    chip.appendChild(drop);
    return chip;
  }));
}

function readBase64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result).split(",", 2)[1] || "");
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFile(file) {
  status(`Reading ${file.name} …`);
  try {
    const data = await readBase64(file);
    const r = await api("/api/attachments", {
      method: "POST", body: JSON.stringify({ name: file.name, data_base64: data }) });
    state.attachments = state.attachments.filter((a) => a.name !== r.name).concat([r]);
    drawAttachments();
    status("");
  } catch (err) { status(`Cannot attach ${file.name}: ${err.message}`); }
}

function autosize() {
  const t = $("input");
  t.style.height = "auto";
  t.style.height = `${Math.min(t.scrollHeight, 200)}px`;
}

function initComposer() {
  $("input").addEventListener("input", () => { autosize(); meterSoon(); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  for (const id of ["max-tokens", "play", "play-user", "play-assistant", "model", "system"]) {
    $(id).addEventListener("change", meterSoon);
  }
  $("attach-file").addEventListener("change", (e) => {
    const file = e.target.files[0];
    e.target.value = "";
    if (file) attachFile(file);
  });
}
