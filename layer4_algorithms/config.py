"""The engine's knobs in one place: `EngineConfig` (and `SpecConfig` for speculative decoding).

    config = EngineConfig(num_blocks=512, block_size=16, max_num_seqs=64)
    llm = LLM("models/course-target", config)              # or LLM(path, num_blocks=512, ...)
    llm.config.max_model_len                               # resolved from the model

Validated once, here, when the object is built: every part of the engine (`BlockManager`,
`Scheduler`, `ModelRunner`, the speculator) receives the same checked object at construction
and reads what it needs. `LLM` resolves the two knobs that depend on the model (max_model_len,
and num_blocks from a byte budget) into a copy (`dataclasses.replace`), so `llm.config` says
what the engine actually runs with. Layer 5 subclasses EngineConfig to add parallel sizes;
layer 6 reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import layer3_model as l3

POLICIES = ("continuous", "static", "priority")
SPEC_METHODS = ("draft", "ngram")
DEFAULT_ATTN_BYTES_LIMIT = 512 * 2**20  # padded attention scores per forward pass (model_runner.py)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding in the engine. method "draft" (a small model; `draft` = its
    checkpoint dir, default the course draft) or "ngram" (prompt lookup, n from ngram[1] down
    to ngram[0]); k guesses per step at most; stop_below: the draft's dynamic length (see
    DraftModelProposer)."""

    method: str = "draft"
    k: int = 4
    draft: str | Path | None = None
    ngram: tuple[int, int] = (1, 4)
    stop_below: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: "
                             f"expected one of {', '.join(SPEC_METHODS)}")
        if not _positive_int(self.k):
            raise ValueError(f"speculative k must be an int >= 1, got {self.k!r}")

    @classmethod
    def of(cls, spec: SpecConfig | dict | None) -> SpecConfig | None:
        """None, a SpecConfig, or its fields as a dict (`speculative=dict(method=..., k=...)`)."""
        if spec is None or isinstance(spec, SpecConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative must be a SpecConfig, a dict of its fields or None, "
                             f"got {type(spec).__name__}")
        return cls(**spec)


#: The most grammar fill threads an engine may ask for (each also compiles every constraint).
MAX_FILL_THREADS = 64

@dataclass
class EngineConfig:
    """Every knob of the engine. Model loading (when LLM is given a path): backend ("torch" |
    "triton" | "compile"), dtype (None: the checkpoint's), device (None: CUDA if present). KV
    cache: block_size tokens per block; the pool is num_blocks, or kv_cache_bytes, or (neither)
    gpu_memory_utilization of free GPU memory / 512 MiB on CPU. Scheduler: at most max_num_seqs
    sequences and max_num_batched_tokens tokens per step; max_model_len (None: the model's
    max_position_embeddings) caps prompt + output; enable_prefix_caching,
    enable_chunked_prefill; scheduling "continuous" (FCFS), "static" (the benchmark baseline:
    fixed batches run to completion) or "priority" (continuous, ordered by (request priority,
    arrival); preemption takes the lowest priority). Runner: cuda_graph (decode steps replayed
    from CUDA graphs, CUDA only), prefill_cuda_graph (steps of up to a few sequences, prefill
    chunks among them, replayed from CUDA graphs per token-count bucket up to
    max_num_batched_tokens: one launch where an eager prefill's host time rivals its GPU time;
    CUDA and the triton backend only; its graphs' pool holds about one forward of
    max_num_batched_tokens tokens; None, the default: on with cuda_graph where it works, a plain
    LlamaModel on CUDA whose attention is the triton backend's flash path, else off),
    attn_bytes_limit (padded attention scores per forward pass before a step is split).
    prefill_attention: the triton backend's attention for a step that is one prompt with
    nothing cached, "flash" (layer 1's kernel, the default) or "cudnn" (cuDNN's fused
    attention through PyTorch: CUDA, fp16/bf16, the triton backend; LLM sets it on the model's
    network, checking those); None: "cudnn" where those hold, else "flash". speculative: a
    SpecConfig or its dict, or None.
    async_scheduling: schedule and prepare step N+1 while the GPU runs step N (its decode
    inputs taken from step N's tokens on the device; step N's tokens read one step later; see
    engine.py). None: on for a CUDA model without speculative decoding, else off; True with
    speculative decoding is an error (verification needs the tokens on the host). Outputs are
    the same either way; while a request with penalties or logprobs is live the engine runs its
    steps synchronously. grammar_fill_threads: threads that fill a step's grammar masks
    (structured outputs; each constraint then compiled once per thread, see
    structured/grammar.py); None: structured.default_lanes (1, or the host's share of CPUs)."""

    backend: str = "torch"
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    cuda_graph: bool = False
    prefill_cuda_graph: bool | None = None
    attn_bytes_limit: int = DEFAULT_ATTN_BYTES_LIMIT
    prefill_attention: str | None = "flash"
    speculative: SpecConfig | dict | None = None
    async_scheduling: bool | None = None
    grammar_fill_threads: int | None = None

    def __post_init__(self) -> None:
        self.speculative = SpecConfig.of(self.speculative)
        problems = [p for p in self._problems() if p]
        if problems:
            raise ValueError("bad EngineConfig: " + "; ".join(problems))

    def _problems(self) -> list[str | None]:
        def positive(name: str, optional: bool = False) -> str | None:
            v = getattr(self, name)
            if (optional and v is None) or _positive_int(v):
                return None
            none = " or None" if optional else ""
            return f"{name} must be an int >= 1{none}, got {v!r}"

        def flag(name: str) -> str | None:
            v = getattr(self, name)
            return None if isinstance(v, bool) else f"{name} must be True or False, got {v!r}"

        util = self.gpu_memory_utilization
        return [
            None if self.backend in l3.BACKENDS else
            f"backend must be one of {', '.join(l3.BACKENDS)}, got {self.backend!r}",
            None if self.prefill_attention in (None, *l3.PREFILL_ATTENTION) else
            f"prefill_attention must be one of {', '.join(l3.PREFILL_ATTENTION)} or None, got "
            f"{self.prefill_attention!r}",
            positive("block_size"), positive("num_blocks", True), positive("kv_cache_bytes", True),
            None if self.num_blocks is None or self.kv_cache_bytes is None else
            "give num_blocks or kv_cache_bytes, not both",
            None if isinstance(util, (int, float)) and 0 < util <= 1 else
            f"gpu_memory_utilization must be in (0, 1], got {util!r}",
            positive("max_num_seqs"), positive("max_num_batched_tokens"),
            positive("max_model_len", True), positive("attn_bytes_limit"),
            positive("grammar_fill_threads", True),
            None if not _positive_int(self.grammar_fill_threads)
            or self.grammar_fill_threads <= MAX_FILL_THREADS else
            f"grammar_fill_threads must be at most {MAX_FILL_THREADS} (each is a thread and a "
            f"compile of every constraint), got {self.grammar_fill_threads}",
            flag("enable_prefix_caching"), flag("enable_chunked_prefill"), flag("cuda_graph"),
            None if self.prefill_cuda_graph is None or isinstance(self.prefill_cuda_graph, bool)
            else f"prefill_cuda_graph must be True, False or None, got {self.prefill_cuda_graph!r}",
            None if self.async_scheduling is None or isinstance(self.async_scheduling, bool) else
            f"async_scheduling must be True, False or None, got {self.async_scheduling!r}",
            None if not (self.async_scheduling and self.speculative is not None) else
            "async_scheduling=True does not work with speculative decoding (verification reads "
            "the tokens on the host every step): leave it None or False",
            None if self.scheduling in POLICIES else
            f"unknown scheduling policy {self.scheduling!r}: expected one of {', '.join(POLICIES)}",
        ]

    def async_for(self, device_type: str, speculating: bool) -> bool:
        """async_scheduling resolved for an engine on `device_type`: None -> on for CUDA
        without a speculator; True with a speculator is an error."""
        if speculating:
            if self.async_scheduling:
                raise ValueError("async_scheduling=True does not work with speculative decoding "
                                 "(verification reads the tokens on the host every step)")
            return False
        if self.async_scheduling is None:
            return device_type == "cuda"
        return self.async_scheduling

    @property
    def resolved_max_model_len(self) -> int:
        """max_model_len, which the parts that need it require to be set (LLM sets it from
        the model: min(max_model_len, max_position_embeddings))."""
        if self.max_model_len is None:
            raise ValueError("EngineConfig.max_model_len is None: LLM resolves it from the model; "
                             "set it when you build a Scheduler or ModelRunner yourself")
        return self.max_model_len
