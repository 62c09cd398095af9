/* A small Markdown renderer that builds DOM nodes and never parses HTML.
 *
 * Model output is untrusted: text only ever reaches the page through textContent and
 * createTextNode, so `<script>` or `<img onerror=...>` in a reply shows as those characters
 * and nothing runs. Links are kept only for http(s) URLs. Supported: fenced code blocks
 * (also an unclosed one while a reply is still streaming), headings, bullet and numbered
 * lists, quotes, paragraphs with line breaks kept (the course model speaks in verse),
 * `code`, **bold**, *italic* and [links](https://...).
 */
"use strict";

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s\n][^*\n]*\*)|(\[[^\]\n]+\]\(https?:\/\/[^\s)]+\))/g;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    const token = m[0];
    if (m[1]) parent.appendChild(el("code", "inline", token.slice(1, -1)));
    else if (m[2]) renderInline(parent.appendChild(el("strong")), token.slice(2, -2));
    else if (m[3]) renderInline(parent.appendChild(el("em")), token.slice(1, -1));
    else {
      const split = token.indexOf("](");
      const a = el("a", null, token.slice(1, split));
      const url = token.slice(split + 2, -1);
      try {
        const parsed = new URL(url);
        if (parsed.protocol === "http:" || parsed.protocol === "https:") a.href = parsed.href;
      } catch (_) { /* not a URL: plain text link label */ }
      a.rel = "noopener noreferrer nofollow";
      a.target = "_blank";
      parent.appendChild(a);
    }
    last = m.index + token.length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function codeBlock(lang, lines) {
  const wrap = el("div", "code-block");
  const head = el("div", "code-head");
  head.appendChild(el("span", "code-lang", lang || "text"));
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  const code = el("code", null, lines.join("\n"));
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code.textContent).then(() => {
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1200);
    });
  });
  head.appendChild(copy);
  wrap.appendChild(head);
  wrap.appendChild(el("pre")).appendChild(code);
  return wrap;
}

function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.replace(/\r\n/g, "\n").split("\n");
  let para = null, list = null, quote = null;
  const close = () => { para = null; list = null; quote = null; };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+#.-]*)\s*$/);
    if (fence) {
      const body = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      root.appendChild(codeBlock(fence[1], body));
      close();
      continue;
    }
    if (!line.trim()) { close(); continue; }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      close();
      renderInline(root.appendChild(el("h" + Math.min(heading[1].length + 2, 6))), heading[2]);
      continue;
    }
    const item = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
    if (item) {
      const tag = item[1] ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        close();
        list = root.appendChild(el(tag));
      }
      renderInline(list.appendChild(el("li")), item[3]);
      continue;
    }
    const q = line.match(/^>\s?(.*)$/);
    if (q) {
      if (!quote) { close(); quote = root.appendChild(el("blockquote")); }
      else quote.appendChild(el("br"));
      renderInline(quote, q[1]);
      continue;
    }
    if (list || quote) close();
    if (para) para.appendChild(el("br"));
    else para = root.appendChild(el("p"));
    renderInline(para, line);
  }
  return root;
}

window.renderMarkdown = renderMarkdown;
