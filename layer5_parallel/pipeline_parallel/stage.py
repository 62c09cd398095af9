"""One stage of the pipelined engine: what it holds, how a step is cut, how stages hand off.

Stage s of p holds a contiguous run of decoder layers (`pipeline.partition`: earlier stages
take the extra ones), stage 0 also the embedding, the last stage also the final norm and LM
head, and a paged KV cache for just its layers. Every stage's cache has the same number of
blocks, so layer 4's block tables (made on rank 0) address every stage's cache alike.

A step's flat tokens are cut into m micro-batches of about equal token counts
(`micro_batches`; a long prefill chunk may be cut too); micro-batch i leaves stage s as the
serving path's residual stream, (x, residual) stacked as (2, T_i, H), and the last stage sends
back fp32 logits. Every message
is preceded by a small header (micro-batch, dtype, shape), checked before the payload is
received: gloo aborts a process that receives more bytes than it posted (and corrupts one
that receives fewer), so stages that disagree get a ValueError naming both shapes instead.
On GPUs the header costs a host round trip per micro-batch (a host-to-device copy to send
it, a device-to-host read to check it, each waiting for the stream's queued work), which
keeps a stage's host from queueing the next micro-batch ahead: there it is sent only with
`checked=True` (tp_check), and a mismatch is NCCL's timeout instead.
"""
from __future__ import annotations

import itertools
from bisect import bisect_left
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import layer4_algorithms as engine

from .training import partition

l3 = engine.executor
HEADER_TAG = 1 << 20  # headers' tags: kept apart from the payloads' (tag = micro-batch)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)


def valid_pp_sizes(config: l3.ModelConfig) -> list[int]:
    """Every stage needs at least one decoder layer: 1 .. num_hidden_layers."""
    return list(range(1, config.num_hidden_layers + 1))


def check_pp_size(config: l3.ModelConfig, stages: int) -> None:
    layers = config.num_hidden_layers
    if not 1 <= stages <= layers:
        raise ValueError(f"pipeline_parallel_size={stages} does not fit a model of {layers} "
                         f"decoder layers (each stage needs at least one); valid sizes: 1 to "
                         f"{layers}")


def stage_config(config: l3.ModelConfig, layers: range) -> l3.ModelConfig:
    """The model's config with only this stage's layers (sizes the stage's KV cache)."""
    return replace(config, num_hidden_layers=len(layers),
                   layer_windows=tuple(config.layer_windows[layers.start:layers.stop]))


class StageNet(nn.Module):
    """Stage `stage` of `stages` cut out of a loaded LlamaModel (its modules, shared, not
    copied): the serving path of LlamaModel.forward, one slice of it per stage."""

    def __init__(self, net: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        self.stage, self.stages = stage, stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.layer_range = partition(net.config.num_hidden_layers, stages)[stage]
        self.full_config = net.config
        self.config = stage_config(net.config, self.layer_range)
        self.ops = net.ops
        self.embed = net.embed if self.first else None
        self.layers = nn.ModuleList(net.layers[i] for i in self.layer_range)
        self.norm = net.norm if self.last else None
        self.lm_head = net.lm_head if self.last else None
        self.register_buffer("cos", net.cos, persistent=False)
        self.register_buffer("sin", net.sin, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attn_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn_norm.weight.device

    @property
    def backend(self) -> str:
        return self.ops.name

    def forward(self, inp: torch.Tensor, ctx, cache, last_only: bool = False) -> torch.Tensor:
        """Stage 0: token ids (T,); the others: the stream (2, T, H). Returns the stream for
        the next stage, or (last stage) fp32 logits (T, V), (B, V) with last_only."""
        if self.first:
            x, residual = self.embed(inp), None
        else:
            x, residual = inp[0], inp[1]
        for layer in self.layers:
            x, residual = layer(x, residual, ctx, cache, self.ops, self.cos, self.sin)
        if not self.last:
            return torch.stack((x, residual))
        if last_only:
            rows = ctx.query_start_loc[1:] - 1
            x, residual = x[rows], residual[rows]
        x, _ = self.norm(x, self.ops, residual)
        # in the weights' dtype: half the hand-off's bytes in bf16 (a 128k vocabulary makes
        # the logits the largest message of a step); rank 0 widens them, the same values
        return self.lm_head(x)


class StageKVCache(engine.PagedKVCache):
    """Layer 4's paged cache over one stage's layers: the model's layer i is entry i - first."""

    def __init__(self, first: int, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first = first

    @classmethod
    def for_stage(cls, stage: StageNet, num_blocks: int, block_size: int) -> StageKVCache:
        c = stage.config
        return cls(stage.layer_range.start, c.num_hidden_layers, num_blocks, block_size,
                   c.num_key_value_heads, c.head_dim, dtype=stage.dtype, device=stage.device)

    def write(self, layer: int, k, v, ctx) -> None:
        super().write(layer - self.first, k, v, ctx)

    def read(self, layer: int, ctx):
        return super().read(layer - self.first, ctx)

    def slot_views(self, layer: int):
        return super().slot_views(layer - self.first)

    def block_views(self, layer: int):
        return super().block_views(layer - self.first)

    def decode_attention(self, layer: int, q, ctx, scale: float, window):
        return super().decode_attention(layer - self.first, q, ctx, scale, window)


# ---- cutting a step into micro-batches ----------------------------------------------------------
def micro_batches(query_lens, m: int, *, split: bool = False) -> list[tuple[int, int]]:
    """Token ranges [(t0, t1)] of the step's flat tokens: at most m contiguous micro-batches,
    none empty, about T/m tokens each. split=False cuts only between sequences; split=True
    anywhere, so one long prefill chunk is pipelined too: a sequence's later piece reads the
    earlier piece's KV, already written, since every stage runs micro-batch i before i + 1.
    (Without a cache — scoring a prompt — a piece would have no KV to read: no split.)"""
    starts = [0, *itertools.accumulate(query_lens)]
    T = starts[-1]
    if split:
        m = max(1, min(m, T))
        cuts = [0, *(round(T * k / m) for k in range(1, m)), T]
        return list(zip(cuts, cuts[1:], strict=False))
    B = len(query_lens)
    m = max(1, min(m, B))
    seq_cuts = [0]
    for k in range(1, m):
        c = bisect_left(starts, T * k / m)  # first sequence boundary with >= k/m of the tokens
        seq_cuts.append(min(max(c, seq_cuts[-1] + 1), B - (m - k)))
    cuts = [starts[c] for c in seq_cuts] + [T]
    return list(zip(cuts, cuts[1:], strict=False))


def pieces(query_lens, t0: int, t1: int) -> list[tuple[int, int, int]]:
    """The sequences' parts in tokens [t0, t1): (sequence b, first, end) of its new tokens."""
    out, start = [], 0
    for b, q in enumerate(query_lens):
        lo, hi = max(t0, start), min(t1, start + q)
        if lo < hi:
            out.append((b, lo - start, hi - start))
        start += q
    return out


def micro_contexts(query_lens, seq_lens, slot_mapping: torch.Tensor,
                   block_tables: torch.Tensor | None, cuts: list[tuple[int, int]],
                   device: torch.device, whole: l3.AttentionContext | None = None
                   ) -> list[tuple[int, int, l3.AttentionContext, list[int]]]:
    """Per micro-batch: (first token, end token, its AttentionContext, which of its pieces end
    their sequence — the rows a last_only step keeps). whole: the step's own context, taken
    as is when the step is one micro-batch (the context this would build again)."""
    if whole is not None and len(cuts) == 1:
        return [(0, cuts[0][1], whole, list(range(len(query_lens))))]
    out = []
    for t0, t1 in cuts:
        ps = pieces(query_lens, t0, t1)
        ctx = l3.AttentionContext.build(
            [e - f for _, f, e in ps], [seq_lens[b] - query_lens[b] + f for b, f, _ in ps],
            slot_mapping[t0:t1], device=device,
            block_tables=None if block_tables is None else block_tables[ps[0][0]:ps[-1][0] + 1])
        out.append((t0, t1, ctx, [j for j, (b, _, e) in enumerate(ps) if e == query_lens[b]]))
    return out


# ---- hand-offs between stages --------------------------------------------------------------------
def _wait(work, what: str, timeout_s: float, device: torch.device | None = None) -> None:
    """Wait for a hand-off. On a CUDA device (NCCL) the wait is stream-ordered: the stream
    waits for the transfer and the host goes on queueing (work.wait with a timeout would block
    the host until the transfer has finished, polling every ~1 ms, so a stage could not queue
    micro-batch i's kernels before micro-batch i had arrived, nor rank 0 the next micro-batch
    while waiting for logits). A stage that stops then shows as rank 0's bounded wait for the
    step's tokens timing out (the engine's wait_event), and NCCL's own timeout. Elsewhere
    (gloo) the host waits, at most timeout_s."""
    if device is not None and device.type == "cuda":
        work.wait()
        return
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        said = str(exc).strip().split(". ")[0]
        raise RuntimeError(f"{what} failed or timed out (waits last at most {timeout_s:g} s; "
                           f"a neighbouring stage died or ran another step): {said}") from exc


def _header(tag: int, t: torch.Tensor) -> list[int]:
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
    shape = list(t.shape) + [0] * (3 - t.dim())
    return [tag, dtype, t.dim(), *shape]


def _p2p(pg, send: bool, t: torch.Tensor, peer: int, tag: int):
    """isend/irecv over `pg` (an engine's own process group), or the default group if None."""
    if pg is None:
        return (dist.isend if send else dist.irecv)(t, peer, tag=tag)
    return pg.send([t], peer, tag) if send else pg.recv([t], peer, tag)


def headers_on(device: torch.device, check: bool) -> bool:
    """Whether hand-offs carry a checked header: always on CPUs (gloo), with tp_check on GPUs."""
    return check or device.type != "cuda"


def send(pg, t: torch.Tensor, dst: int, tag: int, *, checked: bool = True) -> list[tuple]:
    """Post header (if checked) and payload to `dst`; returns (work, tensor) pairs to wait for
    later (the tensors stay referenced until then)."""
    t = t.contiguous()
    sends = [(_p2p(pg, True, t, dst, tag), t)]
    if checked:
        head = torch.tensor(_header(tag, t), dtype=torch.int64, device=t.device)
        sends.insert(0, (_p2p(pg, True, head, dst, HEADER_TAG + tag), head))
    return sends


def recv(pg, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int,
         device: torch.device, timeout_s: float, what: str, *,
         checked: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Receive micro-batch `tag` of `shape` from `src` (after checking its header if checked),
    into `out` if given (contiguous, of that shape and dtype)."""
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    if not checked:
        _wait(_p2p(pg, False, out, src, tag), f"{what}: micro-batch {tag} from rank {src}",
              timeout_s, out.device)
        return out
    want = torch.empty(shape, dtype=dtype, device="meta")
    head = torch.empty(3 + 3, dtype=torch.int64, device=device)
    _wait(_p2p(pg, False, head, src, HEADER_TAG + tag), f"{what}: header from rank {src}",
          timeout_s)
    got, expected = head.tolist(), _header(tag, want)
    if got != expected:
        def words(h: list[int]) -> str:
            dt = _DTYPES[h[1]] if h[1] < len(_DTYPES) else "another dtype"
            return f"micro-batch {h[0]}, shape {tuple(h[3:3 + h[2]])}, {dt}"
        raise ValueError(f"{what}: rank {src} sent ({words(got)}) but this stage expected "
                         f"({words(expected)}): the stages disagree on the step")
    _wait(_p2p(pg, False, out, src, tag), f"{what}: micro-batch {tag} from rank {src}", timeout_s)
    return out


def wait_sends(sends: list[tuple], timeout_s: float, what: str) -> None:
    for work, t in sends:
        _wait(work, what, timeout_s, t.device)


def pp_problems(config) -> list[str | None]:
    """EngineConfig's checks of the pipeline fields (engine_config.py)."""
    pp, m, k = config.pipeline_parallel_size, config.pp_micro_batches, config.pp_steps_in_flight

    def positive_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    return [
        None if positive_int(pp) else f"pipeline_parallel_size must be a positive int, got {pp!r}",
        None if m is None or positive_int(m) else
        f"pp_micro_batches must be a positive int or None, got {m!r}",
        None if positive_int(k) else f"pp_steps_in_flight must be a positive int, got {k!r}",
        *(in_flight_problems(config) if positive_int(k) and k > 1 else []),
        None if pp == 1 or config.tensor_parallel_size == 1 or config.tp_backend == "torch" else
        f"tensor_parallel_size={config.tensor_parallel_size} with pipeline_parallel_size={pp} "
        "runs its stages' collectives in groups of their own: use tp_backend='torch' (layer "
        "2's 'ours' runs over the one default group)",
        None if pp == 1 or not config.cuda_graph or config.tensor_parallel_size == 1 else
        "cuda_graph=True with pipeline_parallel_size > 1 captures each stage's decode "
        "micro-batches on one rank a stage; with tensor_parallel_size > 1 as well it is not "
        "supported (use cuda_graph=False)",
    ]


def in_flight_problems(config) -> list[str | None]:
    """pp_steps_in_flight > 1: what it needs (in_flight.py)."""
    k = config.pp_steps_in_flight
    return [
        None if config.pipeline_parallel_size > 1 else
        f"pp_steps_in_flight={k} needs pipeline_parallel_size > 1 (steps in flight keep the "
        "stages of a pipeline busy; one process has none)",
        None if config.speculative is None else
        f"pp_steps_in_flight={k} does not work with speculative decoding (verification needs "
        "every step's logits at once): use pp_steps_in_flight=1",
        None if config.scheduling != "static" else
        f"pp_steps_in_flight={k} with scheduling='static': the static baseline admits one batch "
        "at a time, steps in flight split it in groups; use 'continuous' or 'priority'",
        None if not isinstance(config.max_num_seqs, int) or config.max_num_seqs >= k else
        f"pp_steps_in_flight={k} splits max_num_seqs={config.max_num_seqs} over {k} groups of "
        "sequences: give max_num_seqs >= pp_steps_in_flight",
    ]
