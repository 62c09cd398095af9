"""Tensor-parallel decode steps replayed from CUDA graphs on every rank, collectives inside.

Layer 4's `CudaGraphRunner` captures one decode step per bucketed batch size over static
buffers. Under tensor parallelism every rank runs it over its own shard and cache: the
shard's forward already calls its collectives (two all-reduces a layer, one for the
embedding, the logits' all-gather), and NCCL collectives are captured like any kernel, so
each rank's graph holds its share of the step and the collectives that join the ranks.
One step then costs each rank one graph launch.

What the workers need each step, and how it reaches them without a host round trip:

    rank 0 (the engine)                         rank r > 0 (runtime/worker.py)
    ring.put(("graph", bucket))  ------------>  ring.get() -> replay graph[bucket]
    copy ids, positions, seq_lens,
    block tables into its static buffers
    replay graph[bucket]:                       graph[bucket]:
      pack the bucket's rows (B, 3 + n)           BROADCAST from rank 0 -> packed rows
      BROADCAST from rank 0 -------------------->  unpack into its static buffers
      slots, shard forward (+ collectives)       slots, shard forward (+ collectives)
      logits (B, V), their greedy argmax          logits, argmax (unused)
      (over its static input ids)

The host message is one small tuple through shared memory (runtime/shm_broadcast.py). The inputs
themselves travel on the GPUs, inside the graph: under async scheduling a decode step's
token ids are the previous step's samples, which live only on rank 0's GPU, so they must
go GPU to GPU anyway, and the positions, lengths and block tables ride along in the same
broadcast (B * (3 + max_blocks) int64) for free. No rank copies anything to or from the
host, and the workers' host work per step is one ring read and one graph launch.

On a CPU (gloo) the same runner runs the same steps without capturing (capture=False), so
the CPU suite tests this path too.
"""
from __future__ import annotations

import gc

import torch

import layer4_algorithms as engine

from ..runtime.comm import TPComm
from ..runtime.rank0 import wait_event
from ..runtime.shm_broadcast import Pickled


class TPGraphRunner(engine.CudaGraphRunner):
    """Layer 4's CudaGraphRunner over one rank's shard, whose step first broadcasts rank 0's
    inputs. Rank 0 calls run(...) (as layer 4's runner, telling the workers which bucket
    first, when `group` is given); the workers call replay(bucket)."""

    def __init__(self, model, cache, max_num_seqs: int, max_blocks_per_seq: int, comm: TPComm,
                 *, group=None, capture: bool = True, warmup: int = 1) -> None:
        self.comm, self.group, self.rank0 = comm, group, comm.rank == 0
        # one row per sequence: token id | position | seq_len | block table (max_blocks)
        self.packed = torch.zeros((max_num_seqs, 3 + max_blocks_per_seq), dtype=torch.int64,
                                  device=model.device)
        super().__init__(model, cache, max_num_seqs, max_blocks_per_seq, capture=capture,
                         warmup=warmup)
        # rank 0's message of each step, pickled once: ("graph", bucket)
        self.messages = {b: Pickled.of(("graph", b)) for b in self.buckets}

    def _step(self, B: int) -> None:
        rows = self.packed[:B]
        fields = (self.input_ids[:B], self.positions[:B], self.seq_lens[:B])
        if self.rank0:
            for j, f in enumerate(fields):
                rows[:, j] = f
            rows[:, 3:] = self.block_tables[:B]
        self.comm.broadcast(rows)
        if not self.rank0:
            for j, f in enumerate(fields):
                f.copy_(rows[:, j])
            self.block_tables[:B] = rows[:, 3:]
        super()._step(B)

    def _capture(self, warmup: int) -> None:
        """Layer 4's capture, after one warm-up pass of every bucket on every rank whose end
        rank 0 waits for with a bound: a worker that fails before or inside its first
        collectives is then named (its error, via the group) instead of leaving rank 0
        blocked in the capture's device synchronize."""
        with torch.no_grad():
            for B in self.buckets:
                self._step(B)
        event = torch.cuda.Event()
        event.record()
        if self.group is not None:
            wait_event(self.group, event, "warming up the decode CUDA graphs")
        else:
            event.synchronize()
        super()._capture(warmup)

    def release(self) -> None:
        """Drop the captured graphs: each holds a reference on the NCCL communicator whose
        collectives it captured, and NCCL's destroy/abort waits until they are gone. Not after
        a failure: freeing a graph's memory syncs the device, which a stuck collective never
        lets return."""
        self.graphs.clear()
        gc.collect()

    def bucket(self, batch: int) -> int:
        return self.bucket_of[batch]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, *, copy: bool = True) -> torch.Tensor:
        """Layer 4's run() (under no_grad there); rank 0 first tells every worker which
        graph to replay."""
        B = input_ids.shape[0]
        if self.group is None or not self.can_run(B, block_tables.shape[1]):
            return super().run(input_ids, positions, block_tables, seq_lens, copy=copy)
        with self.group.guard("decode step (CUDA graph)"):
            self.group.send(self.messages[self.bucket(B)])
            return super().run(input_ids, positions, block_tables, seq_lens, copy=copy)

    def run_host(self, input_ids, positions, block_tables, gather=None) -> torch.Tensor:
        """Layer 4's run_host(); rank 0 first tells every worker which graph to replay."""
        B = positions.shape[0]
        if self.group is None or not self.can_run(B, block_tables.shape[1]):
            return super().run_host(input_ids, positions, block_tables, gather)
        with self.group.guard("decode step (CUDA graph)"):
            self.group.send(self.messages[self.bucket_of[B]])
            return super().run_host(input_ids, positions, block_tables, gather)

    @torch.no_grad()
    def replay(self, bucket: int) -> None:
        """A worker's step: rank 0's inputs arrive by the broadcast inside the graph."""
        if self.captured:
            self.graphs[bucket].replay()
        else:
            self._step(bucket)
