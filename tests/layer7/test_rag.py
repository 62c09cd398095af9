"""RAG: passages, BM25 ranking, the context message, and bad folders."""
from __future__ import annotations

from pathlib import Path

import pytest

from layer7_app.rag import DocIndex, context_message, split_passages


def test_split_keeps_paragraphs_and_caps_length() -> None:
    text = "one two three\n\nfour five\n\n" + " ".join(f"w{i}" for i in range(25))
    passages = split_passages(text, passage_words=10)
    assert passages[0] == "one two three four five"
    assert all(len(p.split()) <= 10 for p in passages)
    assert " ".join(passages).split() == text.split()  # nothing lost, nothing repeated
    assert split_passages("  \n\n ") == []
    with pytest.raises(ValueError):
        split_passages("x", passage_words=0)


def test_search_ranks_the_passage_with_the_query_words_first(tmp_path: Path) -> None:
    (tmp_path / "kernels.md").write_text(
        "# Kernels\n\nA paged attention kernel reads the KV cache block by block.\n\n"
        "Triton compiles the kernel for the GPU.")
    sub = tmp_path / "notes"
    sub.mkdir()
    (sub / "serving.txt").write_text("The router sends each request to a replica.\n\n"
                                     "Prefix-aware routing keeps a conversation on one replica.")
    (tmp_path / "ignored.py").write_text("paged attention kernel KV cache")
    index = DocIndex.from_dir(tmp_path, passage_words=12)
    assert index.sources == ["kernels.md", "notes/serving.txt"]
    best = index.search("which replica does the router pick?", k=2)
    assert best[0].source == "notes/serving.txt" and best[0].score > 0
    top = index.search("paged KV cache", k=1)[0]
    assert top.source == "kernels.md" and "block by block" in top.text
    assert index.search("zebra xylophone") == []  # no shared word: no citation
    cite = top.citation()
    assert cite["source"] == "kernels.md" and cite["passage"] == top.index + 1


def test_context_message_numbers_passages_and_respects_a_budget(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha beta " * 20 + "\n\n" + "alpha gamma " * 20
                                    + "\n\n" + "delta epsilon " * 20)
    passages = DocIndex.from_dir(tmp_path, passage_words=40).search("alpha", k=3)
    assert len(passages) == 2  # the third passage has no "alpha"
    text = context_message(passages)
    assert "[1] (a.txt)" in text and "[2] (a.txt)" in text
    assert len(context_message(passages, max_chars=120)) <= 120


def test_bad_folders_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        DocIndex.from_dir(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="no text"):
        DocIndex.from_dir(tmp_path)
