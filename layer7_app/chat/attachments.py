"""Files attached to a question: their text joins the RAG index the reply searches.

A text or Markdown file is read as UTF-8; a PDF's text comes from `pypdf` (pages in order).
Attachments belong to the session that sent them (another browser's questions never cite
them) and live in memory, beside the app's own --docs index: a restart forgets them, while
the conversation keeps each question's file names.
"""
from __future__ import annotations

import base64
import binascii
import io
import threading

from ..rag import DocIndex, Passage, split_passages

MAX_BYTES = 5 * 1024 * 1024
SUFFIXES = (".txt", ".md", ".pdf")


def extract_text(name: str, data: bytes) -> str:
    """The text of an attached file; ValueError for a kind we cannot read or no text."""
    suffix = "." + name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if suffix not in SUFFIXES:
        raise ValueError(f"{name}: attach a .txt, .md or .pdf file")
    if suffix == ".pdf":
        from pypdf import PdfReader
        from pypdf.errors import PdfReadError

        try:
            reader = PdfReader(io.BytesIO(data))
            text = "\n\n".join(page.extract_text() or "" for page in reader.pages)
        except (PdfReadError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{name}: not a readable PDF ({exc})") from None
    else:
        text = data.decode("utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"{name}: no text in it" + (" (a scanned PDF has only pictures)"
                                                     if suffix == ".pdf" else ""))
    return text


def decode_upload(name: str, data_base64: str) -> bytes:
    """The bytes of an upload sent as base64 (the page reads files with FileReader)."""
    try:
        data = base64.b64decode(data_base64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name}: the upload is not base64") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"{name}: larger than {MAX_BYTES // (1024 * 1024)} MiB")
    return data


class Attachments:
    """Each session's attached passages, and the index a reply of that session searches."""

    def __init__(self, base: DocIndex | None) -> None:
        self.base = base
        self._by_session: dict[int, list[Passage]] = {}
        self._lock = threading.Lock()

    def add(self, session: int, name: str, text: str) -> int:
        """Index `text` as the file `name` for `session`; returns its number of passages."""
        source = f"{name} (attached)"
        chunks = split_passages(text)
        with self._lock:
            kept = [p for p in self._by_session.get(session, []) if p.source != source]
            self._by_session[session] = kept + [Passage(source, i, c)
                                                for i, c in enumerate(chunks)]
        return len(chunks)

    def index_for(self, session: int) -> DocIndex | None:
        """The --docs index plus this session's attachments (None when both are empty)."""
        with self._lock:
            own = list(self._by_session.get(session, []))
        if not own:
            return self.base
        return DocIndex((self.base.passages if self.base is not None else []) + own)
