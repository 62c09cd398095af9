"""When a completion ends, and which of its text may be shown yet: one rule for every loop.

Layer 3's generate, layer 4's engine (`Sequence`), its speculative decoder and layer 6's
streaming all feed sampled tokens, one at a time, to a `FinishRule`:

    rule = FinishRule(params, eos_token_ids=model.eos_token_ids, decoder=tokenizer.decoder())
    for token in sampled:
        piece, reason = rule.append(token)    # text safe to show now, None or why it ended
        ...                                   # (stop feeding once reason is not None)

The rule, in order, for each token:
  1. EOS (one of eos_token_ids, unless params.ignore_eos): finish "eos"; the token is not
     part of the output.
  2. else the token joins `token_ids`; the detokenizer turns it into text ("" while a
     multi-byte UTF-8 character is still incomplete).
  3. a stop string anywhere in the text (a match may begin in text of earlier tokens): the
     text is cut where the first one begins, finish "stop"; the stop string is never output.
  4. len(token_ids) == params.max_tokens: finish "length".
  5. finished by EOS or length: the detokenizer is flushed (an unfinished character becomes
     U+FFFD) and the flushed text is checked for stop strings too.
Streaming: `append` returns only text that no later token can take back: while unfinished,
the longest end of the text that is the beginning of some stop string is held back (it may
yet become the stop string, which must not be shown); once finished, everything left.
So the pieces joined are exactly `text`. Without a decoder (token-id prompts) there is no
text, and stop strings cannot match.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .sampling import SamplingParams


class TextDecoder(Protocol):
    """What the rule needs from a detokenizer (tokenizer.IncrementalDecoder)."""

    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class FinishRule:
    """One completion's finish rule and text. token_ids: the output tokens (EOS excluded);
    text: its text so far (cut before a stop string), including any held-back end;
    finish_reason: None, "eos", "stop" or "length"; emitted: characters of text already
    returned by append."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = (),
                 decoder: TextDecoder | None = None) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.decoder = decoder
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.emitted = 0
        self._stop, self._max_tokens = params.stop, params.max_tokens  # read every token
        # a match may begin this many characters before the newest text
        self._overlap = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> tuple[str, str | None]:
        """Feed one sampled token: (text safe to emit now, finish reason or None). Feeding a
        finished rule is a mistake (ValueError): callers stop at the first reason."""
        if self.finish_reason is not None:
            raise ValueError(f"the completion already finished ({self.finish_reason}): "
                             f"no more tokens")
        if token in self.eos_token_ids:
            self.finish_reason = "eos"
        else:
            self.token_ids.append(token)
            if self.decoder is not None:
                self._add_text(self.decoder.step(token))
            if self.finish_reason is None and len(self.token_ids) >= self._max_tokens:
                self.finish_reason = "length"
        if self.finish_reason is not None and self.decoder is not None \
                and self.finish_reason != "stop":
            self._add_text(self.decoder.flush())  # the last, possibly unfinished, character
        return self._take(), self.finish_reason

    def add(self, token: int) -> str | None:
        """`append` for a caller that does not take the text pieces (it reads `text` and
        `emitted` when it needs them): the same state after each token; returns only the
        finish reason. Without a decoder (no text) it skips the piece's bookkeeping, which
        is then always "": an engine calls this for every sequence every step."""
        if self.decoder is not None or self.finish_reason is not None:
            return self.append(token)[1]
        if token in self.eos_token_ids:
            self.finish_reason = "eos"
        else:
            ids = self.token_ids
            ids.append(token)
            if len(ids) >= self._max_tokens:
                self.finish_reason = "length"
        return self.finish_reason

    def _add_text(self, piece: str) -> None:
        if not piece:
            return
        if not self._stop:  # the common case: nothing to search for
            self.text += piece
            return
        start = max(0, len(self.text) - self._overlap)
        self.text += piece
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def _held(self) -> int:
        """Length of the longest end of text that a stop string begins with (could still
        grow into it); 0 without stop strings."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _take(self) -> str:
        end = len(self.text)
        if self._stop and self.finish_reason is None:
            end -= self._held()
        end = max(end, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece
