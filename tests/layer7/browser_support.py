"""What the browser tests share: Debian's chromium (playwright's own browser download is not
reachable here; `.ci/run` installs the system one), the marks that skip a module without it,
where screenshots go, how long any wait may take, and the page's own steps: open it, send a
message, wait for replies. The `browser` fixture is in conftest.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
DOCS = Path(__file__).resolve().parents[2] / "docs"
WAIT_MS = 60_000
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                       reason=f"{CHROMIUM} is missing: `apt-get install chromium` (.ci/run does)"),
]


def open_page(browser, url: str, errors: list[str] | None = None, *, csp: bool = False,
              **context):
    """A page in a fresh browser context (its own cookies: a new session), models listed.
    The page's CSP forbids eval, which playwright's string predicates use: bypassed unless
    csp=True (the tests that run the page under its own CSP keep it). `context`: more
    browser-context options (viewport: 1280 x 800 unless given)."""
    ctx = browser.new_context(viewport=context.pop("viewport", {"width": 1280, "height": 800}),
                              bypass_csp=not csp, **context)
    page = ctx.new_page()
    page.set_default_timeout(WAIT_MS)
    if errors is not None:
        page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_selector("#model option", state="attached")
    page.wait_for_selector("#conversations[data-loaded]", state="attached")
    return page


def send_message(page, text: str, *, max_tokens: int, seed: int | None, temperature: float,
                 play: bool) -> None:
    """Type and send (settings set on the page's own controls, opened on a phone)."""
    if not page.is_visible("#max-tokens"):
        page.click("#settings-toggle")
    page.set_checked("#play", play)
    page.fill("#max-tokens", str(max_tokens))
    page.eval_on_selector("#temperature", "(el, v) => { el.value = v; "
                          "el.dispatchEvent(new Event('input')); }", str(temperature))
    page.fill("#seed", "" if seed is None else str(seed))
    page.fill("#input", text)
    page.wait_for_function("!document.getElementById('send').disabled")
    page.press("#input", "Enter")


def wait_replies_done(page, n: int) -> None:
    """Until `n` replies are finished (stats drawn, nothing streaming)."""
    page.wait_for_function(
        f"document.querySelectorAll('.message.assistant .stats').length >= {n}"
        " && !document.querySelector('.message.assistant.streaming')")
