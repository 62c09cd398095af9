/* The colour theme, before the page paints: the OS's choice ("auto"), or the one the ◐
 * button stored. app.js cycles it; CSS reads html[data-theme]. */
"use strict";

const THEME_KEY = "llmstack-theme";
const THEMES = ["auto", "dark", "light"];

function applyTheme(theme) {
  const root = document.documentElement;
  if (theme === "dark" || theme === "light") root.dataset.theme = theme;
  else delete root.dataset.theme;
}

function storedTheme() {
  try { return localStorage.getItem(THEME_KEY) || "auto"; } catch (_) { return "auto"; }
}

applyTheme(storedTheme());
