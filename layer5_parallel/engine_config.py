"""Layer 4's EngineConfig with the parallel sizes layer 5 adds.

    EngineConfig(tensor_parallel_size=2, num_blocks=512)   # or LLM(path, tensor_parallel_size=2)

tensor_parallel_size: ranks the model's heads, FFN and vocabulary are split over (1: layer 4's
engine as it is). tp_backend: "torch" (torch.distributed: NCCL on GPUs, gloo on CPUs) or
"ours" (layer 2's collectives from send/recv). tp_check: every torch collective first checks
that all ranks pass the same shape. Two limits bound the waits between ranks:
tp_start_timeout_s the ranks' start-up (spawn, imports, rendezvous, model load, KV caches,
graphs; None: tp_timeout_s), and tp_timeout_s, the step limit, once every rank is up (each
collective and hand-off of a step, shutdown): a rank that stops answering mid-step is declared
hung when it runs out. Each error names the limit that ran out. tp_threads: CPU threads per
rank, rank 0 included (None: cores // ranks). enable_expert_parallel (vLLM's name): an MoE
model's experts are split over the tensor-parallel ranks (E/N whole experts each) instead of
each expert's FFN (see expert_parallel/engine_model.py).
pipeline_parallel_size: stages the layers are cut into (pipeline_parallel/engine.py; the tp_*
knobs apply to its ranks too; with tensor_parallel_size T each stage is T ranks);
pp_micro_batches: micro-batches each step is cut into (None: stages; 1 with steps in flight).
pp_steps_in_flight: steps rank 0 keeps in flight, each over its own group of the running
sequences, so the stages work on different steps at once instead of draining the pipeline
every step (pipeline_parallel/in_flight.py; 1: one step at a time; P: vLLM's virtual engines).
data_parallel_size: whole engines (each tensor_parallel_size x pipeline_parallel_size ranks),
one per process, sharing the requests (data_parallel/replicas.py); dp_devices: the device of
each replica (None: GPU i for replica i on CUDA, else the CPU).
distributed_executor_backend (vLLM's name): "mp" (rank 0 starts the other ranks as processes
on this host) or "external_launcher" (torchrun started every rank, on one host or many, each
running the same script: tensor_parallel/external_launcher.py).
prefill_cuda_graph (layer 4's) runs on one rank only: None ("where it works") turns itself off
with tensor_parallel_size or pipeline_parallel_size above 1, True there is an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import layer4_algorithms as engine

from .pipeline_parallel.stage import pp_problems

TP_BACKENDS = ("torch", "ours")
EXECUTOR_BACKENDS = ("mp", "external_launcher")


def _seconds(value: object) -> bool:
    """A time limit: a finite number of seconds > 0 (not a bool: True would mean 1 s)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


@dataclass
class EngineConfig(engine.EngineConfig):
    tensor_parallel_size: int = 1
    tp_backend: str = "torch"
    tp_check: bool = False
    tp_timeout_s: float = 60.0
    tp_start_timeout_s: float | None = None
    tp_threads: int | None = None
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    pp_micro_batches: int | None = None
    pp_steps_in_flight: int = 1
    distributed_executor_backend: str = "mp"
    data_parallel_size: int = 1
    dp_devices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        # prefill graphs "where they work" (None) are off over several ranks: the workers would
        # have to replay rank 0's graphs (not built); asked for there (True), an error
        if self.prefill_cuda_graph is None and (self.tensor_parallel_size != 1
                                                or self.pipeline_parallel_size != 1):
            self.prefill_cuda_graph = False
        super().__post_init__()

    def _problems(self) -> list[str | None]:
        tp, t, threads = self.tensor_parallel_size, self.tp_timeout_s, self.tp_threads
        dp, start = self.data_parallel_size, self.tp_start_timeout_s
        mine = [
            None if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else
            f"tensor_parallel_size must be a positive int, got {tp!r}",
            None if self.tp_backend in TP_BACKENDS else
            f"tp_backend must be one of {', '.join(TP_BACKENDS)}, got {self.tp_backend!r}",
            None if _seconds(t) else f"tp_timeout_s must be a finite number > 0, got {t!r}",
            None if start is None or _seconds(start) else
            f"tp_start_timeout_s must be a finite number > 0 or None, got {start!r}",
            None if threads is None or (isinstance(threads, int) and threads >= 1) else
            f"tp_threads must be an int >= 1 or None, got {threads!r}",
            None if isinstance(self.enable_expert_parallel, bool) else
            f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}",
            *pp_problems(self),
            None if self.distributed_executor_backend in EXECUTOR_BACKENDS else
            f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got "
            f"{self.distributed_executor_backend!r}",
            None if self.distributed_executor_backend == "mp" or (
                self.pipeline_parallel_size == 1 and not self.enable_expert_parallel
                and self.data_parallel_size == 1) else
            "distributed_executor_backend='external_launcher' runs tensor parallelism only "
            "(pipeline_parallel_size=1, data_parallel_size=1, no expert parallelism)",
            None if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1 else
            f"data_parallel_size must be a positive int, got {dp!r}",
            # (the workers would have to replay rank 0's prefill graphs: not built)
            None if not self.prefill_cuda_graph or (tp == 1 and self.pipeline_parallel_size == 1)
            else "prefill_cuda_graph runs on one rank only (tensor_parallel_size=1, "
                 "pipeline_parallel_size=1)",
            None if self.dp_devices is None or len(self.dp_devices) == dp else
            f"dp_devices names {len(self.dp_devices or ())} devices for data_parallel_size={dp}",
        ]
        return super()._problems() + mine

    @property
    def start_timeout_s(self) -> float:
        """The start-up limit: tp_start_timeout_s, or tp_timeout_s where that is None."""
        return self.tp_start_timeout_s or self.tp_timeout_s

    @classmethod
    def of(cls, config: engine.EngineConfig | None) -> EngineConfig:
        """This class from None, a layer-4 EngineConfig (its fields kept) or itself."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        return cls(**{f.name: getattr(config, f.name) for f in fields(config)})
