"""The planner: per-rank memory, decode latency and throughput of every TP x PP x DP layout.

    stack plan --model llama-3-70b --gpus 8 --device h100 [--batch 64 --context 4096]

For a model shape, N GPUs and a workload (`batch` sequences decoding together at `context`
tokens each), every layout tp * pp * dp = N is costed with the formulas below and the best
one is recommended, with why. The decode step is memory-bound, so the model is a roofline:

  per rank  weights  W_r = (L/pp) * [H (Hq/tp + 2 kv_r) D + Hq/tp D H + 3 H F/tp + 2 H]
                           + V H / tp (embedding, first stage; the LM head, last stage)
            KV       K_r = (B/dp) * S * 2 * (L/pp) * kv_r * D * bytes   (kv_r = max(Hkv/tp, 1))
            activ.   A_r = T_chunk * (3 H + (Hq/tp + 2 kv_r) D + 3 F/tp) * bytes + (B/dp) V 4
  one stage compute  t_c = max((W_r + K_r) / bandwidth, 2 * params_r * B/dp / peak_flops)
            TP comm  t_tp = (2 L/pp + 1) * allreduce(B/dp * H * bytes) + allgather(B/dp * V * bytes)
                     (layer 2's alpha-beta model: the cheaper of ring and tree, as NCCL picks;
                     plus the library's own fixed cost per collective: NCCL's, or none for
                     layer 2's peer-memory kernels, which the link's alpha already describes)
            kernels  t_k = (L/pp) * kernels per layer * fixed cost per kernel (a decode kernel's
                     launch, ramp-up and tail, even replayed from a CUDA graph: why a 1B model
                     at batch 1 cannot stream its weights at the full copy bandwidth); kernels
                     per layer by layer 3's decode path: 5 fused ones for one sequence a rank,
                     ~12 on the general path (cuBLAS, separate norms, RoPE, SiLU)
  step     t = pp * (t_c + t_tp + t_k) + (pp - 1) * p2p(B/dp * H * bytes)
  decode   latency per token = t;   throughput = dp * (B/dp) / t tokens/s

Pipeline stages run one after another for one token, so PP adds memory, not speed, to a
decode step (micro-batching recovers throughput only when compute-bound); TP divides each
step's bytes by tp at the price of 2 all-reduces per layer; DP multiplies throughput.
Ceilings: the datasheet (layer 0) for a named GPU, its bandwidth at the fraction a copy
reaches (layer 0 measured 90 % on an H100); this machine's measured ones for "cpu",
whose ranks share one memory bus and one set of cores (so bandwidth and FLOP/s per rank are
divided by the number of ranks: on one CPU, TP and DP cannot beat one process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import layer4_algorithms as engine

from .tensor_parallel.shard import valid_tp_sizes

l3 = engine.executor
comm = engine.comm
LLAMA_3_8B = dict(
    l3.LLAMA_3_2_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
LLAMA_3_70B = dict(
    LLAMA_3_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
)
SHAPES = {"llama-3.2-1b": l3.LLAMA_3_2_1B, "llama-3-8b": LLAMA_3_8B, "llama-3-70b": LLAMA_3_70B}
DEVICES = {
    "h100": "H100 SXM",
    "h100-pcie": "H100 PCIe",
    "h200": "H200 SXM",
    "a100": "A100 SXM 80GB",
    "l4": "L4",
    "rtx4090": "RTX 4090",
    "mi300x": "MI300X",
}
# GPU-to-GPU links per direction (alpha, GB/s); a CPU's gloo ranks talk over loopback TCP.
LINKS = {"nvlink": (3.0, 450.0), "pcie": (5.0, 32.0), "loopback": (60.0, 2.0)}
# Calibrated on 2x H100 (BENCHMARKS.md: "Layer 2 on NVLink", "Layer 5 on 2 GPUs"): a device copy
# reaches 90 % of the datasheet bandwidth; NCCL's all-reduce takes 12.6 us at 8 KiB where the
# link's alpha-beta (and layer 2's peer-memory one-shot, 5.8 us) say ~6; each decode kernel
# costs ~2 us fixed. Kernels per layer by decode path (layer 3's backends): one sequence a rank
# runs the fused decode kernels (qkv + norm + RoPE + cache write, attention, o_proj, gate_up +
# norm, down + SiLU), more sequences the general path (2 norms, qkv, RoPE, attention, o_proj,
# gate_up, SiLU, down, and cuBLAS's split-K reductions behind the narrow products); the
# all-reduces' own launch is in their alpha. With one count (8) for both paths the 8B batch-32
# steps at TP=2/4 measured 16-22 % slower than predicted (H200s) and batch 1 at TP=1 8 % faster;
# with the count by path every 8B point of TP=1/2/4 on H100s and H200s is within 15 %.
COPY_FRACTION = 0.9
LIBRARY_S = {"torch": 6.5e-6, "ours": 0.0}  # per collective, above the link's alpha-beta
FUSED_KERNELS_PER_LAYER, GENERAL_KERNELS_PER_LAYER = 5, 12
FUSED_DECODE_MAX_SEQS = 1  # layer 3's fused decode path takes steps of at most this many
KERNEL_S = 2e-6


def kernels_per_layer(seqs: int) -> int:
    """Decode kernels a decoder layer launches for `seqs` sequences on one rank (by path)."""
    return FUSED_KERNELS_PER_LAYER if seqs <= FUSED_DECODE_MAX_SEQS else GENERAL_KERNELS_PER_LAYER


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s
    flops: dict[int, float]  # FLOP/s by bytes per weight (4: fp32, 2: bf16)
    memory: float  # bytes per device
    link: comm.AlphaBeta
    shared: bool = False  # one CPU: every rank shares its cores and memory bus
    collective_s: float = 0.0  # the collective library's fixed cost per call (LIBRARY_S)
    kernel_s: float = 0.0  # fixed cost per decode kernel (KERNEL_S on GPUs)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    weights: float  # bytes on the fullest rank
    kv: float
    activations: float
    compute_s: float  # per stage
    tp_comm_s: float  # per stage
    step_s: float
    tokens_per_s: float
    kernels_s: float = 0.0  # per stage: the kernels' fixed costs

    @property
    def memory(self) -> float:
        return self.weights + self.kv + self.activations

    @property
    def comm_share(self) -> float:
        return self.pp * self.tp_comm_s / self.step_s if self.step_s else 0.0


def load_config(model: str) -> l3.ModelConfig:
    """A checkpoint directory (its config.json), a course model ("course-target"), or a known
    shape name (SHAPES). ValueError naming the choices otherwise."""
    if model in SHAPES:
        return l3.ModelConfig.from_dict(SHAPES[model])
    if model.startswith("course-"):
        return l3.ModelConfig.from_pretrained(l3.course_model_dir(model.removeprefix("course-")))
    if Path(model).is_dir():
        return l3.ModelConfig.from_pretrained(model)
    raise ValueError(
        f"--model {model!r} is neither a checkpoint directory nor a known shape: "
        f"{', '.join([*SHAPES, 'course-target', 'course-draft'])}"
    )


def hardware_for(device: str, tp_backend: str = "torch") -> Hardware:
    """A named GPU's datasheet (NVLink between SXM parts, PCIe otherwise), or "cpu": this
    machine's measured ceilings (layer 0; measured now if not cached) and loopback links.
    tp_backend: whose collectives tensor parallelism runs ("torch": NCCL, "ours": layer 2's)."""
    if tp_backend not in LIBRARY_S:
        raise ValueError(f"tp_backend must be one of {', '.join(LIBRARY_S)}, got {tp_backend!r}")
    if device == "cpu":
        c = engine.load_ceilings("cpu")
        link = comm.AlphaBeta.from_link(*LINKS["loopback"])
        flops = {4: c.flops["fp32"], 2: c.flops.get("bf16", c.flops["fp32"])}
        return Hardware(c.device_name, c.memory_bandwidth, flops, 64 * 2**30, link, shared=True)
    if device not in DEVICES:
        raise ValueError(f"unknown --device {device!r}: one of {', '.join([*DEVICES, 'cpu'])}")
    spec = next(s for s in engine.DATASHEETS if s.name == DEVICES[device])
    link = LINKS["nvlink" if "NVLink" in spec.interconnect.split(";")[0] else "pcie"]
    flops = {4: spec.peak_flops["fp32"], 2: spec.peak_flops["bf16"]}
    return Hardware(
        spec.name, COPY_FRACTION * spec.memory_bandwidth, flops, spec.memory_bytes,
        comm.AlphaBeta.from_link(*link), collective_s=LIBRARY_S[tp_backend], kernel_s=KERNEL_S,
    )


def kv_heads_per_rank(c, tp: int) -> int:
    return max(c.num_key_value_heads // tp, 1)


def layer_params(c, tp: int) -> int:
    """One decoder layer's parameters on one of tp ranks (norms whole on every rank)."""
    H, D, F = c.hidden_size, c.head_dim, c.intermediate_size
    q = c.num_attention_heads // tp
    return (
        H * (q + 2 * kv_heads_per_rank(c, tp)) * D + q * D * H + 3 * H * math.ceil(F / tp) + 2 * H
    )


def weight_params(c, tp: int, pp: int = 1) -> int:
    """Parameters on the fullest rank: L/pp layers, the vocab-parallel embedding (and untied
    head, or the head of the last stage when pp > 1) and the final norm."""
    vocab = math.ceil(c.vocab_size / tp) * c.hidden_size
    heads = 1 if c.tie_word_embeddings and pp == 1 else 2
    stage_layers = math.ceil(c.num_hidden_layers / pp)
    return stage_layers * layer_params(c, tp) + (heads if pp == 1 else 1) * vocab + c.hidden_size


def kv_bytes(c, tp: int, pp: int, seqs: int, context: int, nbytes: int = 2) -> int:
    """KV cache of `seqs` sequences of `context` tokens on one rank."""
    layers = math.ceil(c.num_hidden_layers / pp)
    return seqs * context * 2 * layers * kv_heads_per_rank(c, tp) * c.head_dim * nbytes


def tp_comm_seconds(c, tp: int, pp: int, seqs: int, link, nbytes: int = 2,
                    collective_s: float = 0.0) -> float:
    """One stage's collectives per decode step: 2 all-reduces per layer + the embedding's,
    and the logits' all-gather; collective_s: the library's fixed cost of each."""
    if tp == 1:
        return 0.0
    msg = seqs * c.hidden_size * nbytes
    ar = min(
        comm.predict("ring_all_reduce", msg, tp, link),
        comm.predict("tree_all_reduce", msg, tp, link),
    )
    layers = math.ceil(c.num_hidden_layers / pp)
    return (2 * layers + 1) * ar + comm.predict(
        "ring_all_gather", seqs * c.vocab_size * nbytes, tp, link
    ) + (2 * layers + 2) * collective_s


def cost(
    c,
    hw: Hardware,
    tp: int,
    pp: int,
    dp: int,
    *,
    batch: int,
    context: int,
    chunk: int = 2048,
    nbytes: int = 2,
) -> Layout:
    """Per-rank memory and predicted decode step of one layout (formulas in the docstring)."""
    seqs = max(1, math.ceil(batch / dp))
    params = weight_params(c, tp, pp)
    W, K = params * nbytes, kv_bytes(c, tp, pp, seqs, context, nbytes)
    q, kv, F = (
        c.num_attention_heads // tp,
        kv_heads_per_rank(c, tp),
        math.ceil(c.intermediate_size / tp),
    )
    A = (
        chunk * (3 * c.hidden_size + (q + 2 * kv) * c.head_dim + 3 * F) * nbytes
        + seqs * c.vocab_size * 4
    )
    ranks = tp * pp * dp if hw.shared else 1  # a CPU's ranks split one bus and one set of cores
    flops = hw.flops.get(nbytes, hw.flops[2])
    compute = max((W + K) * ranks / hw.bandwidth, 2 * params * seqs * ranks / flops)
    tp_s = tp_comm_seconds(c, tp, pp, seqs, hw.link, nbytes, hw.collective_s)
    kernels = math.ceil(c.num_hidden_layers / pp) * kernels_per_layer(seqs) * hw.kernel_s
    p2p = hw.link.message(seqs * c.hidden_size * nbytes) if pp > 1 else 0.0
    step = pp * (compute + tp_s + kernels) + (pp - 1) * p2p
    return Layout(tp, pp, dp, W, K, A, compute, tp_s, step, dp * seqs / step, kernels)


def layouts(c, hw: Hardware, gpus: int, **workload) -> list[Layout]:
    """Every tp * pp * dp = gpus with a valid tp (<= 8: one node's NVLink) and pp <= layers."""
    out = []
    for tp in valid_tp_sizes(c):
        for pp in range(1, c.num_hidden_layers + 1):
            if tp <= 8 and gpus % (tp * pp) == 0:
                out.append(cost(c, hw, tp, pp, gpus // (tp * pp), **workload))
    return out


def recommend(
    c, hw: Hardware, gpus: int, *, headroom: float = 0.9, **workload
) -> tuple[Layout, str]:
    """The layout that fits (memory <= headroom of a device) with the most tokens/s (ties: the
    lower latency); why, in words. ValueError when nothing fits."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    options = layouts(c, hw, gpus, **workload)
    fits = [lay for lay in options if lay.memory <= headroom * hw.memory]
    if not fits:
        need = min(options, key=lambda lay: lay.memory, default=None)
        raise ValueError(
            f"no layout of {gpus} x {hw.name} fits this model and workload: the leanest "
            f"needs {_gib(need.memory) if need else '?'} per device of "
            f"{_gib(hw.memory)}; use more GPUs, a smaller --batch or --context"
        )
    best = max(fits, key=lambda lay: (lay.tokens_per_s, -lay.step_s))
    lone = cost(c, hw, 1, 1, 1, **workload)
    usable = _gib(headroom * hw.memory)
    why = [f"{_gib(lone.memory)} per replica at tp=pp=1 vs {usable} usable per device"]
    if best.tp > 1:
        why.append(
            f"tp={best.tp} cuts each step's bytes per GPU {best.tp}x; its all-reduces take "
            f"{best.comm_share:.0%} of the step"
        )
    if best.pp > 1:
        why.append(
            f"pp={best.pp} because the weights need {best.tp * best.pp} GPUs of memory and tp "
            "stops at the heads (or a node); pipelining adds no decode speed"
        )
    if best.dp > 1:
        why.append(
            f"the other GPUs run {best.dp} replicas: throughput x{best.dp}, no communication"
        )
    return best, "; ".join(why)


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"
