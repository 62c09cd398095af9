"""Structured outputs: grammar-constrained decoding (JSON schema, JSON object, regex, choice,
Lark grammar) with llguidance. `GrammarCompiler` (constraint -> compiled matcher, on a worker
thread, cached by the constraint), `GrammarState` (one sequence's parser, advanced by each
accepted token), the bitmask (`TokenMasks`: a step's masks in reused buffers, filled on the
engine's thread or, with fill threads, on llguidance's pool over lanes of the grammars
(mask_fill.py), applied by one Triton kernel on CUDA (its copy and launch replayed from a
CUDA graph under CUDA-graph decoding: mask_graph.py);
`mask_rows` before sampling, `mask_spec` before speculative verification,
`apply_token_bitmask_` for any (R, V) logits) and `check` (ValueError naming what is wrong
with a constraint, for layer 6's 400s). (Lab 4's exercise 4 is the mask at teaching size, on
a small automaton: labs/lab4_algorithms/lab4_reference.py.)"""
from .bitmask import TokenMasks, allocate, apply_token_bitmask_, mask_rows, mask_spec, unpack
from .grammar import GrammarCompiler, check, default_lanes, host_lanes, llg_tokenizer, to_grammar
from .mask_fill import fill_masks
from .state import GrammarState

__all__ = ["GrammarCompiler", "GrammarState", "check", "to_grammar", "llg_tokenizer",
           "default_lanes", "host_lanes", "allocate", "unpack", "apply_token_bitmask_",
           "fill_masks", "mask_rows", "mask_spec", "TokenMasks"]
