"""The chat app's built-in tools: a calculator that cannot be made to run code, a search over
the user's documents, and a reply whose tool call the app runs and feeds back to the model
(course model server, tool_choice "required" so the tiny model calls)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import httpx
import pytest

from layer7_app.chat import start_chat, tools
from layer7_app.rag import DocIndex


@pytest.mark.parametrize("expr, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("2 ** 10", 1024), ("7 // 2", 3), ("7 % 4", 3),
    ("-3 + +1", -2), ("10 / 4", 2.5), ("sqrt(16) + abs(-2)", 6.0), ("2 * pi", 2 * math.pi),
])
def test_calculator_computes(expr, value):
    assert tools.calculate(expr) == pytest.approx(value)


@pytest.mark.parametrize("expr, words", [
    ("__import__('os').system('true')", "not allowed"), ("open('x')", "not allowed"),
    ("(1).__class__", "not allowed"), ("'a' * 3", "not allowed"), ("x + 1", "not allowed"),
    ("9 ** 9 ** 9", "too large"), ("1 / 0", "division by zero"), ("2 +", "not an expression"),
    ("1" * 300, "longer than"), ("[1, 2]", "not allowed"), ("lambda: 1", "not allowed"),
])
def test_calculator_refuses_everything_else(expr, words):
    with pytest.raises(ValueError, match=words):
        tools.calculate(expr)


def test_run_tool_reports_errors_as_text(tmp_path: Path):
    assert tools.run_tool("calculator", '{"expression": "6*7"}', None) == "42"
    assert tools.run_tool("calculator", '{"expression": "6*"}', None).startswith("error:")
    assert tools.run_tool("calculator", "not json", None).startswith("error:")
    assert tools.run_tool("rm", "{}", None) == "error: no tool named 'rm'"
    assert "attach" in tools.run_tool("search_documents", '{"query": "ghost"}', None)
    (tmp_path / "ghost.md").write_text("The ghost walks upon the platform at midnight.")
    (tmp_path / "other.txt").write_text("Triton kernels tile the matrix multiplication.")
    found = tools.run_tool("search_documents", '{"query": "ghost"}', DocIndex.from_dir(tmp_path))
    assert found.startswith("[ghost.md #1]") and "midnight" in found
    with pytest.raises(ValueError, match="unknown tool"):
        tools.definitions(["calculator", "shell"])


def test_a_reply_runs_the_models_tool_call_and_feeds_the_result_back(model_server,
                                                                      tmp_path: Path):
    with start_chat(model_server.url, db=tmp_path / "chat.db") as chat:
        client = httpx.Client(base_url=chat.url, timeout=120)
        client.get("/")
        conv = client.post("/api/conversations", json={}).json()["id"]
        body = {"model": "course", "content": "What is 6 times 7?", "max_tokens": 128,
                "temperature": 0.0, "tools": ["calculator"], "tool_choice": "required"}
        with client.stream("POST", f"/api/conversations/{conv}/reply", json=body) as resp:
            assert resp.status_code == 200
            events = [json.loads(line) for line in resp.iter_lines() if line]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "done", kinds
        call = next(e for e in events if e["type"] == "tool_call")["call"]
        assert call["function"]["name"] == "calculator" and call["id"].startswith("call_")
        expression = json.loads(call["function"]["arguments"])["expression"]
        assert re.fullmatch(tools.ARITHMETIC, expression)  # the grammar kept it computable
        result = next(e for e in events if e["type"] == "tool_result")
        assert result["id"] == call["id"]
        assert result["content"] == tools.run_tool("calculator", call["function"]["arguments"],
                                                   None)
        assert kinds.index("tool_result") < len(kinds) - 1  # the model answered after it
        meta = events[-1]["message"]["meta"]
        assert meta["tool_calls"] == [call] and meta["tool_results"][0]["content"] == \
            result["content"]
        # the stored call and result go back to the model in the next reply's history
        body.update(content="And 2 and 2?", tools=[], tool_choice="auto", max_tokens=8)
        with client.stream("POST", f"/api/conversations/{conv}/reply", json=body) as resp:
            assert resp.status_code == 200
            assert json.loads(list(resp.iter_lines())[-1])["type"] == "done"
        bad = client.post(f"/api/conversations/{conv}/reply",
                          json={**body, "tools": ["shell"]})
        assert bad.status_code == 400 and "unknown tool" in bad.text
