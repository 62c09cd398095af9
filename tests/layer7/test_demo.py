"""`stack run --layer 7`: the chat app driven by a scripted conversation, saying per turn
what each layer did (run here against the suite's shared model server)."""
from __future__ import annotations

from layer7_app.bench import commands
from layer7_app.chat import start_chat


def test_the_scripted_conversation_reports_every_layer(model_server, tmp_path, capsys) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "elsinore.txt").write_text(commands.DOC)
    with start_chat(model_server.url, db=tmp_path / "chat.db", docs=docs) as chat:
        commands.converse(chat.url, "course", max_tokens=8)
    out = capsys.readouterr().out
    turns = len(commands.SCRIPT)
    for layer in ("L7 app", "L6 server", "L4 engine", "L3 model"):
        assert out.count(layer) == turns, out
    assert "passage(s) retrieved and cited (elsinore.txt" in out  # the ghost, the platform
    assert f"{2 * turns} messages in SQLite" in out
    # later turns find the earlier ones in the prefix cache
    cached = [int(line.split("prefix cache: ")[1].split()[0])
              for line in out.splitlines() if "prefix cache: " in line]
    assert cached[0] >= 0 and max(cached[1:]) > 0, out
