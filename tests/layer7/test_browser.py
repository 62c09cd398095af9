"""The chat page in a real browser: Debian's chromium driven by playwright.

Playwright's own browser download is not reachable here, so the tests launch the system
executable that `.ci/run` installs (`apt-get install chromium`). Every wait is bounded.
"""
from __future__ import annotations

import functools
import os
import re
import time

import pytest

from layer7_app.chat import COOKIE, ChatHandle, start_chat
from layer7_app.router import start_router
from layer7_app.store import Store

from .browser_support import BROWSER_MARKS, DOCS, open_page, send_message, wait_replies_done
from .conftest import engine_gauges

pytestmark = BROWSER_MARKS
pytest.importorskip("playwright.sync_api")


send = functools.partial(send_message, max_tokens=24, seed=None, temperature=0.8, play=False)
wait_reply_done = wait_replies_done


def start_long_reply(page) -> None:
    """Send a prompt whose reply is still streaming when the test presses Stop, and wait
    until its tokens keep arriving. Seed 1 at temperature 1.5 makes the course model speak
    for the full 300 tokens (greedy replies end in ~20)."""
    send(page, "Speak on, my lord.", max_tokens=300, temperature=1.5, seed=1)
    page.wait_for_function("(document.querySelector('.message.assistant.streaming .body')"
                           " || {}).textContent?.length > 0")
    first = page.inner_text(".message.assistant .body")
    page.wait_for_function(f"document.querySelector('.message.assistant .body')"
                           f".textContent.length > {len(first)}")


def test_the_page_runs_under_its_own_csp(browser, chat: ChatHandle) -> None:
    """The page's scripts and styles all come from its origin: with the CSP in force (no
    bypass), it loads, lists models, sends and draws a reply, and the browser reports no
    violation."""
    violations: list[str] = []
    page = open_page(browser, chat.url, violations, csp=True)
    page.on("console", lambda msg: violations.append(msg.text)
            if "Content Security Policy" in msg.text else None)
    send(page, "Speak on, my lord.", max_tokens=8, temperature=0)
    page.wait_for_selector(".message.assistant .stats")
    assert page.inner_text(".message.assistant .body").strip()
    assert violations == []


def test_reply_streams_in_and_stop_frees_the_engine(browser, chat: ChatHandle,
                                                    gauges) -> None:
    page = open_page(browser, chat.url)
    start_long_reply(page)
    live = gauges()
    assert live["running"] == 1 and live["kv_blocks"] > 0
    page.click("#stop")
    page.wait_for_selector(".message.assistant .stats:has-text('stopped')")
    # The app closed its upstream stream; the engine drops the request at its next step.
    for _ in range(400):  # bounded (20 s): a step is milliseconds, on a busy machine more
        after = gauges()
        if after["running"] == 0 and after["kv_blocks"] == 0:
            break
        time.sleep(0.05)
    assert after["running"] == 0 and after["kv_blocks"] == 0
    time.sleep(0.3)
    assert gauges()["generated"] == after["generated"]  # no more tokens
    page.reload()  # what was said before Stop is kept, marked as stopped
    stats = page.wait_for_selector(".message.assistant .stats:has-text('stopped')").inner_text()
    n_tokens = int(re.search(r"stopped after (\d+) tokens", stats).group(1))
    assert 0 < n_tokens < 300 and page.inner_text(".message.assistant .body").strip()


def test_stop_through_the_router_frees_the_replica(browser, model_server, tmp_path) -> None:
    """With a router in front, Stop still reaches the engine. The chat app closes
    its stream to the router, the router closes its stream to the replica, and the replica
    drops the request and its KV blocks at its next step (read from the replica's /metrics)."""
    replica = model_server.url  # the layer-6 server, started with layer6_serving.start_server
    with start_router([replica], policy="prefix_aware") as router, \
            start_chat(router.url, db=tmp_path / "chat.db") as chat:
        page = open_page(browser, chat.url)  # models listed through the router: ready
        start_long_reply(page)
        live = engine_gauges(replica)
        assert live["running"] == 1 and live["kv_blocks"] > 0
        page.click("#stop")
        page.wait_for_selector(".message.assistant .stats:has-text('stopped')")
        deadline = time.monotonic() + 20  # bounded: a step is milliseconds, on a busy machine more
        while True:
            after = engine_gauges(replica)
            if (after["running"] == 0 and after["kv_blocks"] == 0) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert after["running"] == 0 and after["kv_blocks"] == 0, after
        time.sleep(0.3)
        assert engine_gauges(replica)["generated"] == after["generated"]  # no more tokens
        # the reply did go through the router (picked; a stopped stream is never "served")
        assert [(r.picked, r.in_flight) for r in router.replicas.replicas] == [(1, 0)]


def test_reload_keeps_history_and_other_browsers_see_none_of_it(browser, chat) -> None:
    errors: list[str] = []
    page = open_page(browser, chat.url, errors)
    send(page, "What news, my lord?", play=True)
    wait_reply_done(page, 1)
    send(page, "Good morrow.", play=True)
    wait_reply_done(page, 2)
    texts = "(rows) => rows.map((r) => [r.className, r.querySelector('.speaker').textContent," \
            " r.querySelector('.body').textContent, r.querySelector('.stats')?.textContent])"
    before = page.eval_on_selector_all(".message", texts)
    conv_url = page.url
    assert "#/c/" in conv_url and [b[1] for b in before] == ["HORATIO", "HAMLET"] * 2
    assert before[2][2] == "Good morrow." and "tok/s" in before[3][3]
    page.reload()
    wait_reply_done(page, 2)
    page.wait_for_selector("#conversations[data-loaded]", state="attached")
    assert page.eval_on_selector_all(".message", texts) == before
    assert page.locator(".conversation").count() == 1

    other = open_page(browser, chat.url)  # a second context: another session
    assert other.locator(".conversation").count() == 0
    other.goto(conv_url)  # even knowing the id, the chat is not there (404)
    other.wait_for_function("document.getElementById('status').textContent.includes('404')")
    assert other.locator(".message").count() == 0
    assert errors == []


def test_regenerate_replaces_the_last_reply_and_new_chat_starts_empty(browser, chat) -> None:
    page = open_page(browser, chat.url)
    send(page, "Good morrow.", play=True, temperature=1.0, seed=7)
    wait_reply_done(page, 1)
    stored = ("async () => (await (await fetch('/api/conversations/' +"
              " location.hash.split('/').pop())).json()).messages.map((m) => [m.role, m.content])")
    first = page.evaluate(stored)
    page.fill("#seed", "8")
    page.click(".regen")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 1"
                           " && !!document.querySelector('.message.assistant .stats')"
                           " && !document.querySelector('.message.assistant.streaming')")
    assert page.locator(".message.user").count() == 1
    page.reload()  # the store holds the regenerated reply only
    wait_reply_done(page, 1)
    assert page.locator(".message.assistant").count() == 1
    after = page.evaluate(stored)
    assert [r for r, _ in after] == ["user", "assistant"] and after[0] == first[0]
    assert after[1][1] != first[1][1]  # another seed, another reply, in place of the first
    page.click("#new-chat")
    assert page.locator(".message").count() == 0 and page.is_visible("#empty")


def test_markup_in_a_reply_shows_as_text_and_never_runs(browser, chat, tmp_path) -> None:
    page = open_page(browser, chat.url)
    token = next(c["value"] for c in page.context.cookies() if c["name"] == COOKIE)
    store = Store(tmp_path / "chat.db")  # the same file the app uses
    session = store.ensure_session(token)  # a page load writes no row: its first write does
    conv = store.create_conversation(session, "untrusted")
    store.add_message(session, conv.id, "user", "show me markup")
    evil = ("<script>window.__pwned = 1</script> and <img src=x onerror=\"window.__pwned = 2\">"
            "\n\n**bold** [x](javascript:window.__pwned=3)\n\n```html\n<script>alert(1)</script>"
            "\n```")
    store.add_message(session, conv.id, "assistant", evil, {"stats": {}})
    page.goto(f"{chat.url}/#/c/{conv.id}")
    page.wait_for_selector(".message.assistant .code-block")
    body = page.inner_text(".message.assistant .body")
    assert "<script>window.__pwned = 1</script>" in body
    assert '<img src=x onerror="window.__pwned = 2">' in body
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.locator(".message.assistant a").count() == 0  # a javascript: link stays text
    assert "[x](javascript:window.__pwned=3)" in body
    assert page.evaluate("window.__pwned") is None
    assert page.inner_text(".message.assistant strong") == "bold"


def test_screenshot_of_a_scene(browser, chat, tmp_path) -> None:
    """The picture in layer 7's README. Written to a temporary file, so running the suite leaves
    the checkout clean; LLM_STACK_UPDATE_DOCS=1 writes docs/chat.png instead."""
    page = open_page(browser, chat.url)
    send(page, "Good morrow.", play=True, temperature=0.0)
    wait_reply_done(page, 1)
    send(page, "What news, my lord?", play=True, temperature=0.7, seed=3)
    wait_reply_done(page, 2)
    page.click("#new-chat")
    send(page, "Speak on, my lord.", play=True, temperature=0.7, seed=5)
    wait_reply_done(page, 1)
    page.click(".conversation:has-text('Good morrow.') .open")  # back to the first scene
    page.wait_for_selector(".conversation.active:has-text('Good morrow.')")
    wait_reply_done(page, 2)
    page.mouse.move(700, 600)  # no hover effects in the picture
    target = (DOCS if os.environ.get("LLM_STACK_UPDATE_DOCS") == "1" else tmp_path) / "chat.png"
    target.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(target))
    assert target.stat().st_size > 10_000
