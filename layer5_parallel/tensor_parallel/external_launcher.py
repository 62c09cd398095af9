"""Tensor parallelism with every rank started by torchrun: `distributed_executor_backend=
"external_launcher"` (vLLM's name), one process per GPU, on one host or across hosts.

    # every rank runs the same script
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    outs = llm.generate(prompts, params)        # every rank returns; rank 0's are the answer
    if int(os.environ["RANK"]) == 0: print(outs)

    # two hosts, one GPU each (run on both; HOST0 reachable from HOST1):
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
             --rdzv-endpoint HOST0:29500 script.py

No process is rank 0's helper here: every rank runs layer 4's whole engine (scheduler,
block manager, sampler) over its own shard, in lock step with the others, as vLLM's
external launcher does. The ranks make the same decisions because they see the same
inputs: the same requests in the same order (the script's), the same logits (the shard's
collectives hand every rank the same bits: the all-reduced activations and the all-gathered
logits are identical everywhere), the same KV pool (num_blocks: the smallest any rank can
hold) and the same random streams (an unseeded request draws from a seed rank 0 picks and
every rank shares). So no step needs a message between hosts: the only traffic is the
model's own collectives, and with cuda_graph=True layer 4's runner captures them, as on
one rank.

Joining: every rank reaches torchrun's store (env:// rendezvous: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), marks itself arrived, and waits at most tp_timeout_s for the others;
a rank that never arrives (its script failed before the engine, or its host is slow) is
named in a RuntimeError on every rank that did. A host that never starts torchrun at all
is torchrun's to report: its rendezvous waits `--rdzv-conf join_timeout=SECONDS` (600 by
default) and then fails on the hosts that came.
"""
from __future__ import annotations

import itertools
import os
import random
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

import layer4_algorithms as engine

from ..runtime.comm import TPComm, new_group
from .shard import check_tp_size, shard_model

l3 = engine.executor
_engines = itertools.count()  # engines this process made: every rank makes them in one order


def launcher_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; a clear error without it."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise RuntimeError(f"distributed_executor_backend='external_launcher' expects every rank "
                           f"to be started by torchrun (or to have its variables set); "
                           f"{', '.join(missing)} not set")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


class LaunchedGroup:
    """This rank's place in a torchrun-launched tensor-parallel group: its collectives
    (`comm`), device, and the seed every rank shares."""

    def __init__(self, tp: int, device_type: str, comm_backend: str, check: bool,
                 timeout_s: float, start_timeout_s: float | None = None) -> None:
        rank, world, local = launcher_rank()
        if world != tp:
            raise ValueError(f"torchrun started {world} ranks (WORLD_SIZE) but "
                             f"tensor_parallel_size={tp}: they must be equal")
        if comm_backend != "torch":
            raise ValueError("distributed_executor_backend='external_launcher' runs on "
                             "tp_backend='torch' (NCCL or gloo)")
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        if device_type == "cuda":
            gpus = torch.cuda.device_count()
            if local >= gpus:
                raise ValueError(f"rank {rank} is local rank {local} on its host, which has "
                                 f"{gpus} GPU(s): more ranks per host than GPUs "
                                 "(torchrun --nproc-per-node <= GPUs per host)")
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # joining and agreeing on the pool wait the start-up limit; steps the step limit
        self.start_timeout_s = start_s = start_timeout_s or timeout_s
        store, _, _ = next(dist.rendezvous("env://", rank, world,
                                           timeout=timedelta(seconds=start_s)))
        self.store = dist.PrefixStore(f"llm-stack/engine{next(_engines)}/", store)
        self._arrive(start_s)
        backend = "nccl" if device_type == "cuda" else "gloo"
        pg, _ = new_group(backend, rank, world, 0, start_s, store=self.store)
        self.comm = TPComm("torch", check=check, pg=pg)
        if rank == 0:
            self.store.set("seed", str(random.SystemRandom().randrange(1 << 62)))
        self.seed = int(self.store.get("seed"))
        self.closed = False

    def _arrive(self, timeout_s: float) -> None:
        """Mark this rank arrived; wait for every other rank, naming those that do not come."""
        self.store.set(f"arrived/{self.rank}", "1")
        keys = [f"arrived/{r}" for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError
            late = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise RuntimeError(
                f"external_launcher: rank(s) {late} of {self.world} did not reach the "
                f"tensor-parallel engine within {timeout_s:g} s (the start-up limit, "
                f"tp_start_timeout_s); is every rank "
                f"running this script, and did its engine start? ({type(exc).__name__})"
            ) from exc

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV blocks each GPU can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.comm.all_gather(t).min())

    def steps_begin(self) -> None:
        """Every rank is up: collectives wait at most the step limit from now on."""
        if self.start_timeout_s != self.timeout_s:
            self.comm.pg.set_timeout(timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.close()


def start_launched(model, config) -> tuple[LaunchedGroup, l3.Model, object]:
    """This rank's part of a lock-step engine: its group, its shard as a Model, and the config
    with num_blocks agreed by every rank (the smallest any can hold). Layer 4's engine is then
    built over them as over any Model (llm.py)."""
    tp = config.tensor_parallel_size
    want = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device_type = torch.device(want).type
    if config.tp_threads:
        torch.set_num_threads(config.tp_threads)
    group = LaunchedGroup(tp, device_type, config.tp_backend, config.tp_check,
                          config.tp_timeout_s, config.start_timeout_s)
    try:
        full = model if isinstance(model, l3.Model) else l3.load(
            model, backend=config.backend, dtype=config.dtype, device=group.device)
        check_tp_size(full.config, tp)
        shard = shard_model(full.net, group.rank, tp, group.comm, device=group.device)
        wrapped = l3.Model(shard, full.tokenizer)
        del full
        blocks = engine.LLM.resolve(_Probe(wrapped), config).num_blocks
        config = replace(config, num_blocks=group.agree_min(blocks))
        group.steps_begin()
        return group, wrapped, config
    except BaseException:
        group.close()
        raise


class _Probe:
    """Just enough of an engine for layer 4's resolve(): the model it sizes the pool for."""

    def __init__(self, model) -> None:
        self.model = model


def shared_generator(group: LaunchedGroup, params, index: int, counter) -> torch.Generator:
    """A sequence's random stream, the same on every rank: a seeded request's seed + index
    (layer 4's rule), an unseeded one's the group's seed + the sequence's number (the ranks
    add requests in one order)."""
    seed = params.seed + index if params.seed is not None else group.seed + next(counter)
    return l3.make_generator(l3.SamplingParams(seed=seed), group.device)
