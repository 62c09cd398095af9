"""A tensor-parallel worker process (ranks 1..p-1) and the step message both sides share.

Rank 0 runs layer 4's engine; the workers run only the model. Two channels join them:
- control: small Python messages (what to do next, and host-side integers) come through a
  ring buffer in shared memory that rank 0 writes once for all workers (shm_broadcast.py);
  replies go back through a Pipe per worker. A worker idles on the ring between steps, for
  as long as the engine idles, with no collective timing out; it checks every second that
  rank 0 lives.
- data: one broadcast over the process group carries the step's device tensors, packed
  into one int64 tensor (token ids | slot_mapping | block_tables), so under NCCL rank 0
  never copies them to the host.

Messages rank 0 sends: ("init", num_blocks, block_size) makes the worker's paged KV cache
(its head shard); ("step", query_lens, seq_lens, max_blocks, has_cache, last_only) runs
one forward pass (the broadcast follows); ("copy", pairs) copies KV blocks (copy-on-write);
("graphs", max_num_seqs, max_blocks) captures the decode-step CUDA graphs (tp_graph.py; on a
CPU the same static-buffer step runs eagerly) and ("graph", bucket) replays one, its inputs
arriving inside the graph; ("stop",) ends the loop. The worker answers ("ready",
full_config, shard_config, weight_bytes) after sharding, ("cache", kv_bytes) after init,
("graphs", n) after capturing, and ("error", text) before it exits on any exception (so
rank 0 can name what went wrong on which rank).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection

import torch

import layer4_algorithms as engine

from .ep_model import model_class
from .tp import shard_model, weight_bytes
from .tp_comm import TPComm, new_group
from .tp_graph import TPGraphRunner

POLL_S = 1.0  # how often an idle worker checks that rank 0 is still alive


def step_message(ctx, has_cache: bool, last_only: bool) -> tuple:
    """The host half of a step: everything a worker needs to rebuild rank 0's AttentionContext."""
    max_blocks = -1 if ctx.block_tables is None else int(ctx.block_tables.shape[1])
    return ("step", ctx.query_lens_host, ctx.seq_lens_host, max_blocks, has_cache, last_only)


def pack_step(input_ids: torch.Tensor, ctx) -> torch.Tensor:
    """The device half: ids (T,) | slot_mapping (T,) | block_tables (B * max_blocks,), int64."""
    parts = [input_ids.reshape(-1), ctx.slot_mapping]
    if ctx.block_tables is not None:
        parts.append(ctx.block_tables.reshape(-1))
    return torch.cat([p.to(torch.int64) for p in parts])


def unpack_step(msg: tuple, comm: TPComm, device: torch.device):
    """Receive the broadcast of a step announced by `msg` -> (input_ids, AttentionContext)."""
    _, qlens, slens, max_blocks, _, _ = msg
    T, B = sum(qlens), len(qlens)
    payload = torch.empty(2 * T + max(max_blocks, 0) * B, dtype=torch.int64, device=device)
    comm.broadcast(payload)
    ids, slots = payload[:T], payload[T:2 * T]
    tables = None if max_blocks < 0 else payload[2 * T:].view(B, max_blocks)
    ctx = engine.executor.AttentionContext.build(
        qlens, [s - q for q, s in zip(qlens, slens, strict=True)], slots, block_tables=tables,
        device=device)
    return ids, ctx


def load_full(source: tuple, device: torch.device):
    """The whole model on this worker: ("path", dir, backend, dtype) loads the checkpoint;
    ("state", config, state_dict, backend) rebuilds it from rank 0's (shared-memory) tensors."""
    l3 = engine.executor
    if source[0] == "path":
        _, path, backend, dtype = source
        return l3.load(path, backend=backend, dtype=dtype, device=device).net
    _, config, state, backend = source
    with torch.device("meta"):
        net = model_class(config)(config, backend=backend)  # dense or MoE (ep_model)
    net.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    net.init_rope(device)
    return net.eval()


def worker_main(rank: int, world: int, port: int, backend: str, comm_backend: str, check: bool,
                timeout_s: float, threads: int, source: tuple, conn: Connection,
                fault: str | None = None, *, expert_parallel: bool = False) -> None:
    """Entry point of worker `rank`: join the group, shard, serve steps until ("stop",).
    port: rank 0's TCPStore (its own group), or the default group's rendezvous ("ours").
    fault (tests only): "die" exits at the first step, "hang" sleeps in it, "shape"
    all-reduces a wrong size; "graph-die" and "graph-hang" do so at the first graph step."""

    def body() -> None:
        comm, device = join_group(rank, world, port, backend, comm_backend, check, timeout_s,
                                  threads)
        full = load_full(source, device)
        shard = shard_model(full, rank, world, comm, device=device,
                            expert_parallel=expert_parallel)
        conn.send(("ready", full.config, shard.config, weight_bytes(shard)))
        del full
        _serve(shard, comm, conn, device, fault)

    run_worker(conn, body)


def join_group(rank: int, world: int, port: int, backend: str, comm_backend: str, check: bool,
               timeout_s: float, threads: int) -> tuple[TPComm, torch.device]:
    """A worker's start (any parallel form's): threads, device, and the group (its own, or the
    default one for "ours") -> (comm, device)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if comm_backend == "ours":
        engine.comm.init(backend, timeout_s=timeout_s)
        return TPComm(comm_backend, check=check), device
    pg, store = new_group(backend, rank, world, port, timeout_s)
    comm = TPComm(comm_backend, check=check, pg=pg)
    comm.store = store  # kept alive as long as the group
    return comm, device


def run_worker(conn: Connection, body) -> None:
    """Run a worker's body; on any exception send ("error", text) to rank 0 first. Either way
    leave at once (os._exit: peers and rank 0 are done with us; skip the slow teardown)."""
    try:
        body()
    except BaseException as exc:  # report everything, then leave at once (see launch.py)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def next_message(conn: Connection, parent, who: str) -> tuple:
    """Rank 0's next control message; while none comes, check every POLL_S that rank 0 (the
    parent process) still lives: a worker whose engine died stops instead of idling forever."""
    while not conn.poll(POLL_S):
        if parent is not None and not parent.is_alive():
            raise RuntimeError(f"rank 0 died; this {who} stops")
    return conn.recv()


@torch.no_grad()
def _serve(shard, comm: TPComm, conn: Connection, device: torch.device, fault: str | None) -> None:
    cache, parent, graphs = None, parent_process(), None
    while True:
        msg = next_message(conn, parent, "worker")
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "init":
            cache = engine.PagedKVCache.for_model(shard.config, msg[1], msg[2], dtype=shard.dtype,
                                                  device=device)
            conn.send(("cache", cache.nbytes))
        elif kind == "copy":
            cache.copy_blocks(msg[1])
        elif kind == "graph":
            if fault == "graph-die":
                os._exit(3)
            if fault == "graph-hang":  # a worker stuck mid-step: rank 0 must not wait for ever
                time.sleep(3600)
            graphs.replay(msg[1])
        elif kind == "graphs":
            graphs = TPGraphRunner(shard, cache, msg[1], msg[2], comm,
                                   capture=device.type == "cuda")
            conn.send(("graphs", len(graphs.buckets)))
        elif kind == "step":
            if fault == "die":
                os._exit(3)
            if fault == "hang":
                time.sleep(3600)
            ids, ctx = unpack_step(msg, comm, device)
            if fault == "shape":  # a worker whose row-parallel output has one row too many
                comm.all_reduce(torch.zeros(ids.shape[0] + 1, shard.config.hidden_size,
                                            dtype=shard.dtype, device=device))
            shard(ids, ctx, cache if msg[4] else None, last_only=msg[5])
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")
