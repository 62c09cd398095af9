"""The model's kernels, chosen by backend. The model code is the same for all three.

- "torch":   plain PyTorch, written out below: the reference everything is checked against.
- "triton":  layer 1's fused kernels through layer 2's API: RMSNorm with the residual add
             fused in, RoPE on q and k in one pass, SiLU-and-multiply, FlashAttention-2 for
             prefill (every sequence of a step in one launch; keys after a cached prefix
             read through the cache's block tables in place). With impl="auto" they run
             Triton on CUDA tensors and the torch reference on CPU tensors; impl="triton"
             forces the kernels (Triton's interpreter on a CPU: slow, but it checks the real
             kernel code path).
- "compile": torch.compile of the torch norm, RoPE and SiLU-and-multiply: inductor fuses
             each op's elementwise chain into one kernel (the automatic version of what
             layer 1 wrote by hand). Attention stays eager torch: its matmuls go to the
             BLAS library either way, and its masks change shape with every prefill,
             which would cost a recompilation each (tens of seconds on a CPU).

An op set is a small record of functions:
    rms_norm(x (T, H), w (H,), eps, residual=None) -> y, or (y, x + residual)
    rope(q (T, Hq, D), k (T, Hkv, D), cos, sin (P, D/2), positions (T,)) -> (q, k) rotated
    silu_and_mul(x (T, 2F)) -> (T, F)
    attention(q (T, Hq, D), k, v (T, Hkv, D), ctx, cache, layer, scale, window) -> (T, Hq, D)

A lone prompt with nothing cached may take cuDNN's fused attention instead of the flash
kernel (prefill_attention="cudnn": CUDA, fp16/bf16; off by default): a square causal problem,
where SDPA's top-left mask and ours agree.

Decode steps (ctx.max_query_len == 1) go to the cache's own `decode_attention` when it has
one (layer 4's paged cache: a kernel that reads k/v through block tables in place), in the
torch and triton op sets alike; see attention_context.KVCache.

The triton op set also brings `decode`: fused kernels for small decode steps (at most
FUSED_DECODE_MAX_TOKENS tokens, one per sequence), which the model uses instead of the ops
above when `decode.applies(...)` (see LlamaModel.forward): per layer
    qkv = gemv(rms_norm(x + residual))       one launch: the norm is the GEMV's prologue,
      rope(q, k) + write k, v to the cache      RoPE and the cache write its epilogue
    o = split-context decode attention        one launch (its parts merged in it)
    x = gemv(o) ; gu = gemv(rms_norm(x + residual)) ; x = gemv(silu(gate) * up)
five launches where the general path takes ~14 (fuse_rope=False: six). Prefill, the torch
and compile backends, quantized or Qwen3 (q/k-norm) layers and larger batches keep the
general path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from layer2_comm import kernels

from .attention_context import AttentionContext, ContiguousKVCache, KVCache

BACKENDS = ("torch", "triton", "compile")
#: The triton backend's attention for a lone prompt with nothing cached (one sequence, its own
#: keys): layer 1's flash kernel, or cuDNN's fused attention (CUDA, fp16/bf16; opt-in until a
#: GPU run shows it faster through the engine). Everything else keeps the flash kernels.
PREFILL_ATTENTION = ("flash", "cudnn")
_FLASH_HEAD_DIMS = (16, 32, 64, 128)


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable
    rope: Callable
    silu_and_mul: Callable
    attention: Callable
    decode: DecodeKernels | None = None  # fused small-batch decode (triton backend)
    # rope_write(q, k, v, cos, sin, ctx, cache, layer) -> bool: RoPE and the cache write in
    # one launch (prefill / general path); False when it did nothing (rope + write instead)
    rope_write: Callable | None = None
    impl: str = "auto"  # what the triton backend passes to layer 1's kernels
    prefill_attention: str = "flash"  # a lone prompt's attention (PREFILL_ATTENTION)


# ---- the torch reference ops -----------------------------------------------------------
def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """y = weight * (h / rms(h)), h = x (+ residual); statistics in fp32 (HF's arithmetic)."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, h)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def torch_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each pair (x_i, x_{i+D/2}) by position * inv_freq_i (HF's rotate_half layout)."""
    c = cos[positions].repeat(1, 2)[:, None, :].float()  # (T, 1, D)
    s = sin[positions].repeat(1, 2)[:, None, :].float()
    qf, kf = q.float(), k.float()
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, x = [gate | up] on the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: torch.Tensor,
                     scale: float, window: int | None) -> torch.Tensor:
    """Padded GQA attention. q (B, Mq, Hq, D), k/v (B, Hkv, S, D), q_start (B,): the position
    of each sequence's first query. Query i of sequence b sits at q_start[b] + i and sees keys
    j <= that position (and, with a sliding window, j > position - window). Keys past a
    sequence's length are invisible to its real queries by causality.
    Returns (B, Mq, Hq, D). Scores and softmax in fp32; the matmuls in the input dtype."""
    B, Mq, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv  # query heads per kv head: GQA reads each k/v head once for G queries
    qg = q.view(B, Mq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Mq, D)
    scores = (qg @ k.transpose(-1, -2)).float().view(B, Hkv, G, Mq, S) * scale
    q_pos = q_start[:, None] + torch.arange(Mq, device=q.device)  # (B, Mq)
    k_pos = torch.arange(S, device=q.device)
    visible = k_pos[None, None, :] <= q_pos[:, :, None]  # (B, Mq, S)
    if window is not None:
        visible = visible & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(B, Hkv, G * Mq, S)
    out = (p @ v).view(B, Hkv, G, Mq, D)
    return out.permute(0, 3, 1, 2, 4).reshape(B, Mq, Hq, D)


def _pad(x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Flat (T, H, D) -> right-padded (B, max_query_len, H, D), zeros in the padding."""
    out = x.new_zeros(ctx.num_seqs, ctx.max_query_len, *x.shape[1:])
    out[ctx.seq_ids, ctx.query_offsets] = x
    return out


def _keys_values(k, v, ctx: AttentionContext, cache: KVCache | None, layer: int):
    """(B, Hkv, S, D) keys and values: this step's own when nothing is cached before it
    (prefill: no need to read back what was just written), else the cache's."""
    if cache is None or ctx.is_prefill:
        return _pad(k, ctx).transpose(1, 2), _pad(v, ctx).transpose(1, 2)
    return cache.read(layer, ctx)


def _cache_decodes(ctx: AttentionContext, cache: KVCache | None) -> bool:
    """True when this is a decode step (one new token per sequence) and the cache brings its
    own decode attention (KVCache's optional `decode_attention`; layer 4's paged cache)."""
    return ctx.max_query_len == 1 and callable(getattr(cache, "decode_attention", None))


def torch_attention(q, k, v, ctx: AttentionContext, cache: KVCache | None, layer: int,
                    scale: float, window: int | None) -> torch.Tensor:
    """Attention for the flat batch: pad the queries per sequence, attend, unpad (T, Hq, D).
    Decode steps over a cache with its own decode_attention are handed to it (T == B)."""
    if _cache_decodes(ctx, cache):
        return cache.decode_attention(layer, q, ctx, scale, window)
    keys, values = _keys_values(k, v, ctx, cache, layer)
    out = masked_attention(_pad(q, ctx), keys, values, ctx.seq_lens - ctx.query_lens, scale, window)
    return out[ctx.seq_ids, ctx.query_offsets]


# ---- fused small-batch decode (layer 1's gemv, rope_cache_write, paged_decode) -------------
#: layer 1's paged_decode config for the contiguous cache's decode (None: its default_config):
#: 64 keys a loop step (parts of 64-384 keys at a 1B decode's 129-384-key contexts: 2-6
#: parts, not 2-3 of 128) and trigger_early, which lets the o_proj GEMV after it launch while
#: it runs (that GEMV fetches its weights before its PDL wait: at the 1B tile, the whole
#: matrix). H200, 1B batch 1 from a CUDA graph (benchmarks/profile_decode.py --pdl, both in
#: one run, twice): 1,277.9 / 1,276.8 tok/s, MBU 73.8 %, vs layer 1's default config 1,254.3 /
#: 1,253.4 (72.4 %); the early trigger alone 1,248.0 / 1,273.5 (another run: 1,270.3 vs
#: 1,251.1 / 1,230.3, the same greedy tokens as without it). On an H100, 64-key steps alone
#: had been level with 128 (974.6 vs 975.2 tok/s).
ATTENTION_CONFIG: dict | None = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                                 "trigger_early": True}
#: Fewest key positions one part of a split decode attention takes (its merge is in-kernel).
#: H100, 1B decode at 128-384 keys: 64 -> 975.2 tok/s, 128 -> 967.3 (layer 1's default
#: config; its BLOCK_N 64 config: 974.6 / 966.9)
MIN_SPLIT_TOKENS = 64
_MAX_SPLITS = 64
_DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _slot_views(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This layer's cache as flat (slots, kv_heads, head_dim) views, the rows `write`
    scatters to: the cache's own `slot_views`, or layer 3's contiguous cache; else None."""
    views = getattr(cache, "slot_views", None)
    if callable(views):
        return views(layer)
    if isinstance(cache, ContiguousKVCache):
        k, v = cache.k[layer], cache.v[layer]
        return k.view(-1, *k.shape[-2:]), v.view(-1, *v.shape[-2:])
    return None


def _block_views(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This layer's cache as (blocks, page, kv_heads, head_dim) views that ctx.block_tables
    index (block_tables None: sequence b is block b): the cache's own `block_views` (layer
    4's paged cache), or layer 3's contiguous cache (a block is a row of max_len slots)."""
    views = getattr(cache, "block_views", None)
    if callable(views):
        return views(layer)
    if isinstance(cache, ContiguousKVCache):
        return cache.k[layer], cache.v[layer]
    return None


def _num_splits(batch: int, kv_heads: int, context: int, device: torch.device) -> int:
    """Parts per context: ~8 programs per SM, none shorter than MIN_SPLIT_TOKENS. Host ints."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 1)
    wanted = -(-8 * sms // (batch * kv_heads))
    return max(1, min(wanted, -(-context // MIN_SPLIT_TOKENS), _MAX_SPLITS))


def _fusable(m, dtype: torch.dtype) -> bool:
    """A projection the fused kernels can compute: a plain nn.Linear of x's dtype, or a
    bias-free module with a weight that finishes the GEMV's output itself with `combine(y)`
    (layer 5's tensor-parallel linears: an all-reduce or all-gather after their shard's GEMV)."""
    if getattr(m, "weight", None) is None or m.weight.dtype != dtype:
        return False
    return type(m) is torch.nn.Linear or (callable(getattr(m, "combine", None))
                                          and getattr(m, "bias", None) is None)


def _combined(linear, y: torch.Tensor) -> torch.Tensor:
    combine = getattr(linear, "combine", None)
    return y if combine is None else combine(y)


def _gemv_combined(linear, x: torch.Tensor, silu: bool) -> torch.Tensor | None:
    """A projection that runs its GEMV and its combine itself, `gemv_combined(x, silu)` (layer
    5's row-parallel linears: a GEMV that sends its outputs to the peers from its epilogue, and
    the all-reduce's receive), or None: then the GEMV here and combine after it."""
    fused = getattr(linear, "gemv_combined", None)
    return fused(x, silu) if callable(fused) else None


#: Most tokens (sequences) a decode step may have to take the fused path; larger steps take
#: the general path (cuBLAS GEMMs, layer 1's norm / RoPE / SiLU kernels). Layer 1's gemv takes
#: up to 8 rows, but it keeps its (rows x BLOCK_N x BLOCK_K) product tile in registers, so the
#: weight tile one loop step loads shrinks as 1/rows, and each program recomputes the norm (or
#: SiLU) of every row: weight bytes in flight per SM (benchmarks/gemv_occupancy.py, compiled
#: for sm_90a, layer 1's current tiles), 1B o_proj / gate_up / down, 8B gate_up / down:
#: 62/64/62/56/93 KB at 1 row, 31/36/8/32/47 at 2, 12/14/4/18/23 at 4, 6/6/2/8/12 at 8.
#: Measured with the earlier tiles (benchmarks/backend_sweep.py, H200, graph replay, context
#: 192), fused / general step tok/s at 1, 2, 4, 8 sequences: 1B 1.27x, 0.45x, 0.22x, 0.08x;
#: 8B 1.06x, 0.50x, 0.19x, 0.06x. The fused path wins only at 1.
FUSED_DECODE_MAX_TOKENS = 1


@dataclass(frozen=True)
class DecodeKernels:
    """The triton backend's fused decode kernels, bound to an impl ("auto" / "triton")."""
    impl: str
    max_tokens: int = FUSED_DECODE_MAX_TOKENS  # at most layer 1's gemv.MAX_ROWS (8)
    fuse_rope: bool = True  # RoPE + the cache write in the qkv GEMV's epilogue (one launch)

    def applies(self, model, x: torch.Tensor, ctx: AttentionContext, cache) -> bool:
        """True when this step can take the fused path: a decode step (one new token per
        sequence, at most max_tokens) over a cache with flat slot views, on the device the
        kernels run on, with plain nn.Linear projections in x's dtype and no q/k-norm."""
        if cache is None or ctx.max_query_len != 1 or not 1 <= ctx.num_tokens <= self.max_tokens:
            return False
        if x.dtype not in _DECODE_DTYPES or not kernels.use_triton(self.impl, x, "decode"):
            return False
        if kernels.INTERPRETED and x.dtype == torch.bfloat16:  # its attention dots bf16
            return False
        c = model.config
        if c.qk_norm or c.head_dim not in _FLASH_HEAD_DIMS + (256,):
            return False
        if not callable(getattr(cache, "decode_attention", None)) or _slot_views(cache, 0) is None:
            return False
        linears = [model.lm_head] + [m for layer in model.layers for m in
                                     (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up,
                                      layer.mlp.down)]
        return all(_fusable(m, x.dtype) for m in linears)

    def norm_linear(self, x, residual, norm, linear, out_dtype=None):
        """rms_norm(x + residual) @ W^T -> (y, new residual); residual None: (y, x).
        out_dtype: y stored as it (rounded to x's dtype first), e.g. fp32 logits."""
        y, h = kernels.gemv_rms_norm(x, linear.weight, norm.weight, norm.eps, residual,
                                     linear.bias, impl=self.impl, out_dtype=out_dtype)
        return _combined(linear, y), (x if residual is None else h)

    def norm_qkv_rope_write(self, x, residual, norm, linear, heads: tuple[int, int, int],
                            cos, sin, ctx, cache, layer: int):
        """norm_linear of the qkv projection with RoPE on q, k and k, v written to the
        cache; heads = (q heads, kv heads, head_dim). Returns (qkv (T, N), new residual)."""
        k_slots, v_slots = _slot_views(cache, layer)
        y, h = kernels.gemv_rms_norm_rope(x, linear.weight, norm.weight, norm.eps, residual,
                                          linear.bias, cos, sin, ctx.positions, k_slots,
                                          v_slots, ctx.slot_mapping, *heads, impl=self.impl)
        return y, (x if residual is None else h)

    def linear(self, x, linear):
        y = _gemv_combined(linear, x, False)
        if y is not None:
            return y
        return _combined(linear, kernels.gemv(x, linear.weight, linear.bias, impl=self.impl))

    def silu_linear(self, gu, linear):
        y = _gemv_combined(linear, gu, True)
        if y is not None:
            return y
        return _combined(linear, kernels.gemv_silu_mul(gu, linear.weight, linear.bias,
                                                       impl=self.impl))

    def rope_write(self, q, k, v, cos, sin, ctx, cache, layer: int) -> None:
        k_slots, v_slots = _slot_views(cache, layer)
        kernels.rope_cache_write(q, k, v, cos, sin, ctx.positions, k_slots, v_slots,
                                 ctx.slot_mapping, impl=self.impl)

    def attention(self, q, ctx, cache, layer: int, scale: float, window: int | None):
        """Decode attention, the new k, v already in the cache: the contiguous cache's rows
        read in place by layer 1's split kernel; any other cache through its own
        decode_attention (layer 4's paged cache: the same kernel through block tables)."""
        if not isinstance(cache, ContiguousKVCache):
            return cache.decode_attention(layer, q, ctx, scale, window)
        k, v = cache.k[layer], cache.v[layer]  # (batch, max_len, kv_heads, D): page = max_len
        splits = _num_splits(q.shape[0], k.shape[2], cache.max_len, q.device)
        return kernels.paged_decode(q, k, v, ctx.block_tables, ctx.seq_lens, scale, window,
                                    splits, config=ATTENTION_CONFIG)


# ---- layer 1's kernels -------------------------------------------------------------------
def _triton_ops(impl: str, prefill_attention: str = "flash") -> Ops:
    cudnn = prefill_attention == "cudnn"

    def rms_norm(x, weight, eps, residual=None):
        return kernels.rms_norm(x, weight, eps=eps, residual=residual, impl=impl)

    def rope(q, k, cos, sin, positions):
        return kernels.apply_rope(q, k, cos, sin, positions=positions, impl=impl)  # in place

    def silu_and_mul(x):
        return kernels.silu_and_mul(x, impl=impl)

    def attention(q, k, v, ctx: AttentionContext, cache, layer, scale, window):
        if _cache_decodes(ctx, cache):  # layer 4's paged decode kernel
            return cache.decode_attention(layer, q, ctx, scale, window)
        head_dim = q.shape[-1]
        windowed = window is not None and ctx.max_seq_len > window
        # The flash kernels have no sliding window. Decode steps take the padded torch path,
        # which has fixed shapes and so can be captured in a CUDA graph.
        if ctx.max_query_len == 1 or windowed or head_dim not in _FLASH_HEAD_DIMS:
            return torch_attention(q, k, v, ctx, cache, layer, scale, window)
        # Token-major (n, H, D) rows throughout, read by the kernels through their strides,
        # each sequence's output landing in its rows of `out`. Causal alignment bottom-right:
        # exactly right for a chunk of new queries after a cached prefix.
        lone = (cache is None or ctx.is_prefill) and len(ctx.query_lens_host) == 1
        if lone and cudnn:  # its own output buffer (token-major), no copy into an `out`
            return kernels.cudnn_attention_tokens(q, k, v, scale=scale)
        out = torch.empty_like(q)
        if cache is None or ctx.is_prefill:  # keys: this step's own rows, nothing cached
            if lone:  # one prompt: the single-sequence kernel
                return kernels.flash_attention_tokens(q, k, v, out, scale=scale, impl=impl)
            return kernels.flash_attention_varlen(q, k, v, out, ctx.query_start_loc,
                                                  ctx.query_lens, ctx.max_query_len,
                                                  scale=scale, impl=impl)
        # Keys in the cache (this step's already written): every sequence in one launch,
        # read through the block tables in place; a cache without block views is gathered
        # (its `read`: (B, Hkv, S, D)) and read as one row per sequence.
        views = _block_views(cache, layer)
        if views is None:
            keys, values = cache.read(layer, ctx)
            views, tables = (keys.transpose(1, 2), values.transpose(1, 2)), None
        else:
            tables = ctx.block_tables
        return kernels.flash_attention_varlen(q, *views, out, ctx.query_start_loc, ctx.seq_lens,
                                              ctx.max_query_len, block_tables=tables,
                                              paged=True, scale=scale, impl=impl)

    def rope_write(q, k, v, cos, sin, ctx: AttentionContext, cache, layer: int) -> bool:
        """Rotate q, k in place and write k, v at ctx.slot_mapping in one launch (layer 1's
        rope_cache_write: what apply_rope + cache.write leave, bit for bit) where the cache
        has flat slot views of k's dtype and the kernel runs here; else False, nothing done."""
        views = _slot_views(cache, layer)
        if (views is None or views[0].dtype != k.dtype
                or not kernels.use_triton(impl, q, "rope_cache_write")):
            return False
        kernels.rope_cache_write(q, k, v, cos, sin, ctx.positions, *views, ctx.slot_mapping,
                                 impl=impl)
        return True

    return Ops("triton", rms_norm, rope, silu_and_mul, attention,
               None if impl == "torch" else DecodeKernels(impl),
               None if impl == "torch" else rope_write, impl, prefill_attention)


def pads_prefill_attention(net) -> bool:
    """Whether net's attention pads a multi-token step: the general path (torch_attention)
    pads every sequence's queries to the step's longest and its keys to the longest context,
    B x max_query_len x max_seq_len scores (what layer 4's runner bounds by splitting a step
    into passes). The triton backend's flash kernels take each sequence at its own length,
    except where a layer falls back to the general path: a sliding window, or a head_dim the
    kernels lack. A net without ops or a config: True."""
    ops, config = getattr(net, "ops", None), getattr(net, "config", None)
    if getattr(ops, "name", None) != "triton" or config is None:
        return True
    return (config.head_dim not in _FLASH_HEAD_DIMS
            or any(w is not None for w in config.layer_windows))


def cudnn_attention_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why prefill_attention "cudnn" cannot run on weights on `device` in `dtype`, or None."""
    if device.type != "cuda":
        return (f"prefill_attention='cudnn' runs cuDNN, which needs the model on a CUDA GPU; "
                f"it is on {device}")
    if dtype not in (torch.float16, torch.bfloat16):
        return f"prefill_attention='cudnn' needs fp16 or bf16 weights; the model is {dtype}"
    return None


def cudnn_attention_works(net) -> bool:
    """Whether prefill_attention "cudnn" can run on `net`: a network with set_backend on the
    triton backend, its weights on a CUDA GPU in fp16/bf16."""
    return (hasattr(net, "set_backend") and getattr(net, "backend", None) == "triton"
            and cudnn_attention_refusal(net.device, net.dtype) is None)


def make_ops(backend: str = "torch", *, impl: str = "auto",
             prefill_attention: str = "flash") -> Ops:
    """The op set for a backend ("torch", "triton", "compile"). impl ("auto", "triton",
    "torch") is passed to layer 1's kernels by the "triton" backend. prefill_attention
    (PREFILL_ATTENTION): a lone prompt's attention; "cudnn" only with the triton backend (the
    others have no flash path to replace), where the model then runs on a CUDA GPU in
    fp16/bf16 (see LlamaModel.set_backend, which checks that)."""
    if prefill_attention not in PREFILL_ATTENTION:
        raise ValueError(f"unknown prefill_attention {prefill_attention!r}: expected one of "
                         f"{', '.join(PREFILL_ATTENTION)}")
    if prefill_attention != "flash" and backend != "triton":
        raise ValueError(f"prefill_attention={prefill_attention!r} needs the triton backend "
                         f"(it replaces that backend's flash kernel); got backend {backend!r}")
    if backend == "torch":
        return Ops("torch", torch_rms_norm, torch_rope, torch_silu_and_mul, torch_attention)
    if backend == "triton":
        return _triton_ops(impl, prefill_attention)
    if backend == "compile":
        # dynamic=True: the token count changes every step; one graph serves them all.
        def compiled(fn: Callable) -> Callable:
            return torch.compile(fn, dynamic=True)
        return Ops("compile", compiled(torch_rms_norm), compiled(torch_rope),
                   compiled(torch_silu_and_mul), torch_attention)
    raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
