"""Retrieval-augmented generation over local files: BM25 (`rank-bm25`) on passages.

`DocIndex.from_dir(DIR)` reads every .txt and .md file under DIR, cuts each into passages
of about `passage_words` words (whole paragraphs where they fit, so a passage rarely starts
mid-thought), and indexes them with BM25 (its BM25+ variant), the classic lexical ranking
function: a passage scores high when it contains the query's rare words, often, and is not long.
Plain Okapi BM25 gives a word found in half the passages an IDF of zero (and a negative one
above half), so in a folder of two files it ranks nothing; BM25+ keeps every IDF positive.
A passage that shares no word with the query is never returned, whatever its score.
`search(query)` returns the best passages; `context_message(passages)` turns them into a
system message that the chat app puts before the conversation, and the page shows each
passage's file as a citation under the reply.

BM25 needs no model and no GPU, which keeps `stack chat --docs DIR` working offline on a
laptop; a dense retriever would find paraphrases BM25 misses, at the cost of an embedding model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rank_bm25 import BM25Plus

SUFFIXES = (".txt", ".md")
_WORD = re.compile(r"\w+", re.UNICODE)
# Function words carry no topic: without this list "where does the ghost walk?" would cite
# every passage that has a "the" in it.
STOPWORDS = frozenset(
    "a an and are as at be but by do does did for from had has have he her his how i if in "
    "into is it its me my no not of on or our she so than that the their them then there "
    "these they this to was we were what when where which who why will with you your".split())


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens, function words left out: what BM25 matches on."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


@dataclass(frozen=True)
class Passage:
    """A piece of a document: `source` is its path relative to the indexed folder."""

    source: str
    index: int  # passage number within its file, from 0
    text: str
    score: float = 0.0

    def citation(self) -> dict[str, object]:
        """What the page shows under a reply (a short excerpt, never the whole passage)."""
        excerpt = " ".join(self.text.split()[:40])
        return {"source": self.source, "passage": self.index + 1,
                "score": round(self.score, 3), "excerpt": excerpt}


def split_passages(text: str, passage_words: int = 200) -> list[str]:
    """Cut `text` into passages of at most ~`passage_words` words along paragraph breaks.

    A paragraph longer than the limit is cut on word boundaries; blank text gives [].
    """
    if passage_words < 1:
        raise ValueError(f"passage_words must be positive, got {passage_words}")
    passages: list[str] = []
    current: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        words = paragraph.split()
        while len(words) > passage_words:  # an over-long paragraph: cut it on its own
            if current:
                passages.append(" ".join(current))
                current = []
            passages.append(" ".join(words[:passage_words]))
            words = words[passage_words:]
        if current and len(current) + len(words) > passage_words:
            passages.append(" ".join(current))
            current = []
        current.extend(words)
    if current:
        passages.append(" ".join(current))
    return passages


class DocIndex:
    """A BM25 index over the passages of a folder's text and Markdown files."""

    def __init__(self, passages: list[Passage]) -> None:
        if not passages:
            raise ValueError("no passages to index")
        self.passages = passages
        # A passage of only punctuation gets a placeholder token that no query produces
        # (rank-bm25 divides by the average passage length).
        tokens = [tokenize(p.text) or ["\x00"] for p in passages]
        self._words = [set(t) for t in tokens]
        self._bm25 = BM25Plus(tokens)

    @classmethod
    def from_dir(cls, folder: Path | str, passage_words: int = 200) -> DocIndex:
        """Index every .txt/.md file under `folder` (recursively)."""
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise ValueError(f"--docs {folder}: not a directory")
        files = sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
        passages = []
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            rel = path.relative_to(root).as_posix()
            passages += [Passage(rel, i, chunk)
                         for i, chunk in enumerate(split_passages(text, passage_words))]
        if not passages:
            raise ValueError(f"--docs {folder}: no text in any .txt or .md file there")
        return cls(passages)

    @property
    def sources(self) -> list[str]:
        """The indexed files, in order."""
        return sorted({p.source for p in self.passages})

    def search(self, query: str, k: int = 3) -> list[Passage]:
        """The `k` best passages that share a word with `query`, best first."""
        terms = tokenize(query)
        if not terms or k < 1:
            return []
        scores = self._bm25.get_scores(terms)
        wanted = set(terms)
        matching = [i for i, words in enumerate(self._words) if words & wanted]
        ranked = sorted(matching, key=lambda i: -scores[i])[:k]
        return [Passage(self.passages[i].source, self.passages[i].index, self.passages[i].text,
                        float(scores[i])) for i in ranked]


def context_message(passages: list[Passage], max_chars: int | None = None) -> str:
    """The system message that hands the retrieved passages to the model.

    `max_chars` caps its length, so a small context window (the course model's 512 tokens)
    still has room for the conversation; the best passages come first and survive the cut.
    """
    parts = [f"[{i + 1}] ({p.source}) {p.text}" for i, p in enumerate(passages)]
    text = "Use these passages to answer; cite them as [n].\n" + "\n".join(parts)
    if max_chars is not None and len(text) > max_chars:
        text = text[:max(0, max_chars)].rsplit(" ", 1)[0]
    return text
