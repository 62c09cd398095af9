"""Constraints -> grammars -> compiled matchers, with llguidance, off the step's critical path.

A request's `StructuredOutputsParams` (a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar) becomes one llguidance grammar (`to_grammar`). Compiling it against
the model's vocabulary (`GrammarCompiler.compile`) builds the lexer and parser tables: from
well under a millisecond (a small schema) to tens of milliseconds (a large one), too long to
do inside a step that takes a few. So compiling runs on a worker thread the moment a request
arrives (llguidance releases the GIL while it builds), and overlaps the request's prefill; the
first mask waits for it only if it is not done by then. Compiled grammars are cached by the
constraint's key: a second request with the same schema starts from a copy of the compiled
matcher at once.

The vocabulary ("tokenizer info"): llguidance reads the model's own `tokenizer.json` (the
`tokenizers` byte-level BPE this project trains, or a checkpoint's), so it knows the bytes of
every token id, which it needs to decide which tokens can extend the text without leaving the
grammar. JSON is compiled compact (no free whitespace between tokens, "," and ":" as
separators): a small model cannot then stall in an endless run of spaces and newlines.

Lanes: the copies of one compiled matcher share its lexer behind one lock (llguidance builds
the lexer's automaton lazily and keeps it with the compiled grammar), and a row's mask holds
that lock for its whole token-trie walk. So rows of one schema cannot fill in parallel
unless they hang off different compiles of it: with `lanes` = L > 1 the compiler keeps up
to L compiled matchers per constraint (lane i compiled when a request first lands on it) and
deals its requests' states out to them in turn; mask_fill.py fills the lanes on L threads.
(Opt-in: on a GPU host the pool over lanes has not yet been shown to pay; mask_fill.py.)
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING

import layer3_model as l3

from .state import GrammarState

if TYPE_CHECKING:
    import llguidance


def llg() -> ModuleType:
    """llguidance, imported on first use: the engine (and every layer above it) imports
    without it; only a constrained request needs it (ImportError says how to get it)."""
    try:
        import llguidance
    except ImportError as e:
        raise ImportError("structured outputs need the llguidance package: "
                          "pip install llguidance") from e
    return llguidance

# compact JSON; `lenient` off: a keyword llguidance cannot enforce is an error, not ignored
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def to_grammar(spec: l3.StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) for a constraint. Does not check it (`check`)."""
    kind = spec.kind
    if kind == "json":
        return llg().LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg().LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg().LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg().LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llg().LLMatcher.grammar_from_lark(spec.grammar)


def check(spec: l3.StructuredOutputsParams,
          tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """ValueError naming the problem when the constraint cannot be compiled (an unknown JSON
    schema type, a regex that does not parse, a grammar error). No model needed: layer 6 calls
    it before a request reaches the engine."""
    try:
        grammar = to_grammar(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid {spec.kind} constraint: {e}") from e
    is_error, messages = llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"invalid {_name(spec)}: {_first_line(messages[0])}")


def _name(spec: l3.StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[spec.kind]


def _first_line(message: str) -> str:
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else "rejected by the grammar compiler"


def llg_tokenizer(tokenizer: l3.Tokenizer, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary: the tokenizer.json text, the logits'
    width (a model's embedding may have more rows than the tokenizer has tokens: those ids
    are never allowed) and the ids that end a sequence."""
    eos = list(eos_token_ids) or None
    return llg().LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles constraints for one model, on `threads` worker threads, caching the compiled
    matchers of the last `cache_size` distinct constraints (each in up to `lanes` compiles:
    the module docstring says why). `compile(spec, lane)` returns a Future of a fresh
    llguidance LLMatcher (nothing consumed); copy it before use (`state(spec)`, a new
    sequence's GrammarState, does). Nothing is built until the first constraint comes.
    `stats`: compiles, cache hits and seconds spent compiling."""

    def __init__(self, tokenizer: l3.Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], *, threads: int = 1,
                 cache_size: int = 256, lanes: int = 1) -> None:
        self._source = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None  # built by the first compile
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.lanes = max(1, lanes)
        self._next_lane = itertools.count()  # requests dealt out to the lanes in turn
        self._cache: OrderedDict[tuple[tuple[str, str], int], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"compiles": 0, "hits": 0, "compile_s": 0.0}

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, on first use)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg_tokenizer(self._source, self.vocab_size,
                                                self.eos_token_ids)
            return self._tokenizer

    @classmethod
    def for_model(cls, model: l3.Model, **kwargs) -> GrammarCompiler:
        return cls(model.tokenizer, model.config.vocab_size, model.eos_token_ids, **kwargs)

    def compile(self, spec: l3.StructuredOutputsParams, lane: int = 0) -> Future:
        """Future of the compiled (fresh) matcher of lane `lane`; from the cache when seen
        before."""
        if self._source is None:
            raise ValueError("structured outputs need the model's tokenizer (tokenizer.json): "
                             "this model has none")
        key = (spec.key, lane)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats["hits"] += 1
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="grammar")
            fut = self._pool.submit(self._build, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size * self.lanes:
                self._cache.popitem(last=False)
        return fut

    def next_lane(self, spec: l3.StructuredOutputsParams) -> tuple[Future, int]:
        """(the compiled matcher's Future, its lane) for the next state of spec: the lanes
        in turn."""
        lane = next(self._next_lane) % self.lanes
        return self.compile(spec, lane), lane

    def state(self, spec: l3.StructuredOutputsParams) -> GrammarState:
        """A new sequence's grammar state; its compile starts now (or comes from the cache).
        ValueError for a constraint that cannot compile (checked here, once per constraint:
        the request is refused when it is added, not failed in a step)."""
        with self._lock:
            seen = any((spec.key, i) in self._cache for i in range(self.lanes))
        if not seen:
            check(spec)
        compiled, lane = self.next_lane(spec)
        return GrammarState(compiled, self.eos_token_ids, lane=lane,
                            relane=partial(self.next_lane, spec))

    def _build(self, spec: l3.StructuredOutputsParams) -> llguidance.LLMatcher:
        t0 = time.perf_counter()
        matcher = llg().LLMatcher(self.tokenizer, to_grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {_name(spec)}: {_first_line(matcher.get_error())}")
        with self._lock:
            self.stats["compiles"] += 1
            self.stats["compile_s"] += time.perf_counter() - t0
        return matcher

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# fill threads by default for a GPU engine (a CPU engine's step is its model's matmuls,
# which want the cores): proven, or not, by benchmarks/structured_gpu.sh on a GPU host
POOL_BY_DEFAULT = False


def host_lanes() -> int:
    """Fill threads (= lanes) this host can give an engine: half its CPUs up to 8 when it has
    >= 8, else 1 (a step that is the host's time is worth spreading over idle cores, not over
    busy ones)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cpus = os.cpu_count() or 1
    return min(8, cpus // 2) if cpus >= 8 else 1


def default_lanes(device_type: str) -> int:
    """The engine's fill threads when its config leaves them to it (grammar_fill_threads=None):
    host_lanes() for a CUDA engine if POOL_BY_DEFAULT, else 1."""
    return host_lanes() if device_type == "cuda" and POOL_BY_DEFAULT else 1
