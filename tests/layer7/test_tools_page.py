"""The chat page draws a tool call and its result (headless chromium, course model server):
the calculator enabled and "Must call" checked, the reply's bubble shows the call the model
made and the result the app fed back, while streaming and after a reload."""
from __future__ import annotations

import pytest

from layer7_app.chat import ChatHandle

from .browser_support import BROWSER_MARKS

pytestmark = BROWSER_MARKS
pytest.importorskip("playwright.sync_api")


def test_a_tool_call_and_its_result_are_drawn_in_the_reply(browser, chat: ChatHandle, tmp_path):
    errors: list[str] = []
    page = browser.new_context(viewport={"width": 1280, "height": 800},
                               bypass_csp=True).new_page()
    page.set_default_timeout(120_000)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(chat.url)
    page.wait_for_selector("#model option", state="attached")
    page.set_checked("#play", False)
    page.set_checked("#tool-calculator", True)
    page.set_checked("#tool-required", True)
    page.fill("#max-tokens", "80")
    page.fill("#seed", "1")
    page.fill("#input", "What is 6 times 7?")
    page.press("#input", "Enter")
    page.wait_for_selector(".message.assistant .stats")
    call = page.inner_text(".message.assistant .tool-call")
    assert call.startswith("▸ calculator(") and '"expression"' in call
    assert "→ " in page.inner_text(".message.assistant .tool-result")
    page.screenshot(path=str(tmp_path / "tool_call.png"))
    page.reload()  # drawn again from the stored reply
    page.wait_for_selector("#conversations[data-loaded]", state="attached")
    page.click("#conversations a, #conversations button, #conversations [data-id]")
    page.wait_for_selector(".message.assistant .tool-call")
    assert page.inner_text(".message.assistant .tool-call") == call
    assert errors == []
