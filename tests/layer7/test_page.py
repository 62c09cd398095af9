"""The chat page as people expect it, in a real browser (Debian's chromium via playwright):
a phone layout, the newcomer's fixes (the list, cut replies, banners, delete), the context
meter, branches, copy, export / import, the system prompt, dark mode, live tok/s, search and
attachments. One chat app and one browser for the module; every wait is bounded.

LLM_STACK_UPDATE_DOCS=1 writes the screenshots to docs/ (else to a temporary folder).
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest

from layer7_app.chat import start_chat

from .browser_support import BROWSER_MARKS, DOCS, open_page, send_message, wait_replies_done
from .test_page_api import pdf_with_text

pytestmark = BROWSER_MARKS
pytest.importorskip("playwright.sync_api")
PHONE = {"width": 390, "height": 844}
NO_SCROLL_X = ("() => [document.documentElement, document.body, document.querySelector('.main'),"
               " document.getElementById('messages')].every((e) => e.scrollWidth <= e.clientWidth)")


@pytest.fixture(scope="module")
def chat(model_server, tmp_path_factory):
    with start_chat(model_server.url, db=tmp_path_factory.mktemp("page") / "chat.db") as handle:
        yield handle


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return DOCS if os.environ.get("LLM_STACK_UPDATE_DOCS") == "1" else \
        tmp_path_factory.mktemp("shots")


send = functools.partial(send_message, max_tokens=12, seed=1, temperature=0.7, play=True)
wait_done = wait_replies_done


def test_phone_layout_no_sideways_scroll_drawer_and_toolbar(browser, chat, shots) -> None:
    errors: list[str] = []
    page = open_page(browser, chat.url, errors, viewport=PHONE)
    drawer = "document.getElementById('sidebar').getBoundingClientRect()"
    assert page.evaluate(f"{drawer}.right") <= 0  # the list is a drawer, closed
    send(page, "Good morrow, my lord. Whatnewsfromthecourtandthecitythisverymorning?")
    wait_done(page, 1)
    send(page, "What news from Verona?", seed=3)
    wait_done(page, 2)
    for width in (360, 390, 430):
        page.set_viewport_size({"width": width, "height": 844})
        assert page.evaluate(NO_SCROLL_X), width
        # words are not broken letter by letter: a bubble is most of the screen wide
        assert page.eval_on_selector(".message.user .body", "e => e.offsetWidth") > width * 0.5
        for control in ("#menu", "#model", "#send", "#settings-toggle", ".attach"):
            box = page.locator(control).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= width, (control, width)
    page.set_viewport_size(PHONE)
    page.click("#settings-toggle")  # the settings fold away again
    page.click("#menu")
    page.wait_for_function(f"{drawer}.x >= 0")
    assert page.locator(".conversation").count() == 1
    page.click(".conversation .open")  # choosing a chat closes the drawer
    page.wait_for_function(f"{drawer}.right <= 0")
    page.click("#settings-toggle")
    assert page.is_visible("#max-tokens") and page.is_visible("#seed")
    assert page.evaluate(NO_SCROLL_X)
    page.click("#settings-toggle")
    page.screenshot(path=str(shots / "chat-phone.png"))
    assert errors == []


def test_new_chat_is_listed_at_once_and_no_stale_banner(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Speak on, my lord.", max_tokens=300, temperature=1.5, seed=1)
    # listed while its first reply is still streaming, titled by its first words
    page.wait_for_selector(".message.assistant.streaming")
    assert page.locator(".conversation.active:has-text('Speak on, my lord.')").count() == 1
    page.click("#stop")
    wait_done(page, 1)
    page.goto(chat.url + "/#/c/0123456789abcdef")  # a chat that is not there: a banner
    page.wait_for_function("document.getElementById('status').textContent.includes('404')")
    page.click("#new-chat")
    page.wait_for_function("document.getElementById('status').textContent === ''")
    assert page.is_visible("#empty")


def test_delete_asks_first(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "To be deleted.")
    wait_done(page, 1)
    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    page.click(".conversation.active .delete")
    for _ in range(400):  # the dialog's handler runs as playwright's events arrive (a busy
        if asked:         # machine: later than any fixed wait); up to 10 s
            break
        page.wait_for_timeout(25)
    assert asked and "To be deleted." in asked[0] and page.locator(".conversation").count() == 1
    page.once("dialog", lambda d: d.accept())
    page.click(".conversation.active .delete")
    page.wait_for_function("document.querySelectorAll('.conversation').length === 0")
    assert page.is_visible("#empty")


def test_a_reply_cut_by_max_tokens_is_marked(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Speak on, my lord.", max_tokens=3, temperature=1.5, seed=1)
    wait_done(page, 1)
    assert page.inner_text(".message.assistant .cut-mark") == "✂ cut at max tokens (3)"
    page.reload()  # stored that way
    page.wait_for_selector(".message.assistant .cut-mark")


def test_the_context_meter_counts_and_warns_before_sending(browser, chat) -> None:
    page = open_page(browser, chat.url)
    page.fill("#input", "Good morrow.")
    page.wait_for_function("/\\/ 512 tokens of context/.test("
                           "document.getElementById('meter').textContent)")
    short = int(page.get_attribute("#meter", "data-tokens"))
    page.fill("#input", "Good morrow, good my lord, and welcome home.")
    page.wait_for_function(f"+document.getElementById('meter').dataset.tokens > {short}")
    page.fill("#input", "word " * 1000)  # about 5,000 characters, the newcomer's message
    page.wait_for_selector("#meter.over")
    assert "Will not fit" in page.inner_text("#meter") and page.is_disabled("#send")
    page.press("#input", "Enter")
    page.wait_for_timeout(300)
    assert page.locator(".message").count() == 0  # nothing was sent
    page.fill("#input", "Good morrow.")
    page.wait_for_function("!document.getElementById('meter').classList.contains('over')")
    assert page.is_enabled("#send")


def test_edit_a_sent_message_and_switch_between_branches(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Who's there?")
    wait_done(page, 1)
    first_reply = page.inner_text(".message.assistant .body")
    page.click(".message.user .edit")
    page.fill(".edit-box textarea", "Nay, answer me: stand, and unfold yourself.")
    page.click(".edit-box .save-edit")
    page.wait_for_selector(".message.user .branch-count:has-text('2/2')")
    wait_done(page, 1)
    assert page.inner_text(".message.user .body").startswith("Nay, answer me")
    page.click(".message.user .branch-prev")
    page.wait_for_selector(".message.user .branch-count:has-text('1/2')")
    assert page.inner_text(".message.user .body") == "Who's there?"
    assert page.inner_text(".message.assistant .body") == first_reply
    page.click(".message.user .branch-next")
    page.wait_for_selector(".message.user .branch-count:has-text('2/2')")
    page.fill("#seed", "9")
    page.click(".regen")  # a regeneration is a branch of the reply
    page.wait_for_selector(".message.assistant .branch-count:has-text('2/2')")
    assert page.locator(".message").count() == 2


def test_copy_a_reply(browser, chat) -> None:
    page = open_page(browser, chat.url, permissions=["clipboard-read", "clipboard-write"])
    send(page, "Good morrow.")
    wait_done(page, 1)
    page.click(".message.assistant .copy-reply")
    page.wait_for_selector(".copy-reply:has-text('Copied')")
    reply = page.get_attribute(".message.assistant", "data-text")
    assert reply and page.evaluate("navigator.clipboard.readText()") == reply


def test_export_markdown_and_json_then_import(browser, chat, tmp_path) -> None:
    page = open_page(browser, chat.url)
    page.click("#system-toggle")
    page.fill("#system", "Speak in verse.")
    send(page, "What of the wormwood?")
    wait_done(page, 1)
    with page.expect_download() as md:
        page.click("#export-md")
    text = Path(md.value.path()).read_text()
    assert "## HORATIO\n\nWhat of the wormwood?" in text and "Speak in verse." in text
    with page.expect_download() as js:
        page.click("#export-json")
    data = json.loads(Path(js.value.path()).read_text())
    assert data["format"] == "llm-stack.conversation" and len(data["messages"]) == 2
    page.click("#new-chat")
    page.set_input_files("#import-file", files=[{"name": "chat.json", "mimeType":
                                                 "application/json",
                                                 "buffer": json.dumps(data).encode()}])
    page.wait_for_function("document.querySelectorAll('.conversation').length === 2")
    wait_done(page, 1)
    assert page.inner_text(".message.user .body") == "What of the wormwood?"
    assert page.input_value("#system") == "Speak in verse."  # the system prompt came along
    page.reload()
    wait_done(page, 1)
    assert page.input_value("#system") == "Speak in verse."


def test_dark_mode_follows_the_os_and_switches(browser, chat) -> None:
    page = open_page(browser, chat.url, color_scheme="dark")
    background = "getComputedStyle(document.body).backgroundColor"
    assert page.evaluate(background) == "rgb(15, 17, 23)"  # the OS says dark
    page.click("#theme")  # auto -> dark (explicit)
    page.click("#theme")  # dark -> light
    assert page.evaluate(background) == "rgb(247, 247, 248)"
    page.reload()
    page.wait_for_selector("#model option", state="attached")
    assert page.evaluate(background) == "rgb(247, 247, 248)"  # remembered
    page.click("#theme")  # light -> as the OS again
    assert page.evaluate(background) == "rgb(15, 17, 23)"


def test_live_tokens_per_second_while_streaming(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Speak on, my lord.", max_tokens=300, temperature=1.5, seed=1)
    page.wait_for_function("/streaming · \\d+ tokens · [\\d.]+ tok\\/s/.test("
                           "(document.querySelector('.message.assistant.streaming .live')"
                           " || {}).textContent)")
    page.click("#stop")
    wait_done(page, 1)
    assert page.locator(".live").count() == 0  # the final stats replace it


def test_search_over_conversations(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Tell me of the wormwood and the weeds.")
    wait_done(page, 1)
    page.click("#new-chat")
    send(page, "Good morrow.")
    wait_done(page, 1)
    page.fill("#search", "WORMWOOD")
    page.wait_for_function("document.querySelectorAll('.conversation').length === 1")
    assert "wormwood" in page.inner_text(".conversation .snippet").lower()
    page.click(".conversation .open")
    page.wait_for_selector(".message.user:has-text('wormwood')")
    page.fill("#search", "nothing like this anywhere")
    page.wait_for_selector(".no-results")
    page.fill("#search", "")
    page.wait_for_function("document.querySelectorAll('.conversation').length === 2")



def test_a_slow_older_list_never_replaces_a_newer_one(browser, chat) -> None:
    """The list is fetched from many places at once (a reply ends, a chat opens, a search is
    typed) and answers may come back out of order: only the latest request may draw."""
    page = open_page(browser, chat.url)
    held = []

    def hold_the_first_listing(route) -> None:
        if route.request.method == "GET" and not held:
            held.append((route, route.fetch()))  # the list as it is now: empty
        else:
            route.continue_()

    page.route("**/api/conversations", hold_the_first_listing)
    page.evaluate("() => { window.older = loadConversations(); }")
    for _ in range(200):  # bounded: the request reaches the handler within moments
        if held:
            break
        page.wait_for_timeout(25)
    assert held, "the first listing never reached the test's route"
    page.evaluate("() => api('/api/conversations', "
                  "{ method: 'POST', body: JSON.stringify({ title: 'The newer chat' }) })")
    page.evaluate("() => loadConversations()")
    assert page.locator(".conversation .open").all_inner_texts() == ["The newer chat"]
    route, response = held[0]
    route.fulfill(response=response)  # the older, empty answer arrives last
    page.evaluate("() => window.older")
    assert page.locator(".conversation .open").all_inner_texts() == ["The newer chat"]

def test_attach_a_pdf_to_the_question(browser, chat, shots) -> None:
    page = open_page(browser, chat.url)
    pdf = pdf_with_text("The ghost of Elsinore walks upon the battlements at midnight.")
    page.set_input_files("#attach-file", files=[{"name": "ghost.pdf", "mimeType":
                                                 "application/pdf", "buffer": pdf}])
    page.wait_for_selector("#attached .chip:has-text('ghost.pdf · 1 passage')")
    send(page, "Where walks the ghost?")
    wait_done(page, 1)
    assert page.inner_text(".message.user .chip") == "attached: ghost.pdf"
    assert "ghost.pdf (attached)" in page.inner_text(".message.assistant .citations summary")
    assert page.is_hidden("#attached")  # attached to that question only
    page.set_input_files("#attach-file", files=[{"name": "x.exe", "mimeType": "text/plain",
                                                 "buffer": b"MZ"}])
    page.wait_for_function("document.getElementById('status').textContent.includes('.pdf')")
    send(page, "And who keeps the gate?", seed=2)
    wait_done(page, 2)
    page.mouse.move(700, 600)
    page.screenshot(path=str(shots / "chat-desktop.png"))
    assert re.search(r"tok/s", page.inner_text(".message.assistant .stats"))


def test_every_feature_runs_under_the_csp(browser, chat) -> None:
    """With the page's own Content-Security-Policy in force (no inline script, handler or
    style allowed), the phone drawer, settings, theme, meter, attach, send, edit and copy
    all work and the browser reports no violation."""
    problems: list[str] = []
    page = open_page(browser, chat.url, problems, csp=True, viewport=PHONE)
    page.on("console", lambda msg: problems.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    page.click("#menu")
    page.click("#theme")
    page.wait_for_selector("html[data-theme='dark']", state="attached")
    page.click("#close-drawer")
    page.click("#settings-toggle")
    page.fill("#max-tokens", "6")
    page.click("#system-toggle")
    page.fill("#system", "Be brief.")
    page.set_input_files("#attach-file", files=[{"name": "note.txt", "mimeType": "text/plain",
                                                 "buffer": b"The ghost walks at midnight."}])
    page.wait_for_selector("#attached .chip")
    page.fill("#input", "Where walks the ghost?")
    page.wait_for_selector("#meter[data-tokens]")
    page.press("#input", "Enter")
    page.wait_for_selector(".message.assistant .actions .regen")  # stored, drawn, idle
    page.click(".message.user .edit")
    page.fill(".edit-box textarea", "When walks the ghost?")
    page.click(".edit-box .save-edit")
    page.wait_for_selector(".message.user .branch-count:has-text('2/2')")
    assert problems == []
