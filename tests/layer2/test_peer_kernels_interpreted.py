"""Our peer-memory kernels run on the CPU: W forked processes, each one rank, through Triton's
interpreter, over shared memory that every rank maps at the same address (as NVLink peer
memory is mapped into every GPU's address space).

What this checks is the kernels' data logic: which block copies, sums, pushes or pulls which
elements, the buffer halves, the per-block counters, the blocks-by-size split (`active`) and
the pull/push two-shot, against the exact sum, over many calls in a row with sizes and
algorithms interleaved. The cross-GPU barrier itself is PTX (one lane per peer, `st.release.sys`
/ `ld.acquire.sys`) that the interpreter cannot run: here it is replaced by the same protocol
in Python (epoch flags per block in the shared pads), so ordering bugs in the data logic still
show as wrong sums. The PTX is compiled (not run) in test_peer_kernels_compile.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from layer1_kernels import interpreter  # noqa: F401  (first: TRITON_INTERPRET on a CPU)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the multigpu tests run the real kernels")


def _interpreted(kernels) -> bool:
    return type(kernels.one_shot_kernel).__name__ == "InterpretedFunction"


class _Rank:
    """The host side of PeerAllReduce for one rank, on shared CPU memory."""

    def __init__(self, rank, world, bufs, pads, blocks, num_warps, max_elems, serial, pull):
        from layer2_comm import peer_kernels as K

        self.K, self.rank, self.world = K, rank, world
        self.bufs, self.pads, self.blocks, self.num_warps = bufs, pads, blocks, num_warps
        self.max_elems, self.serial, self.pull = max_elems, serial, pull
        self.state = torch.zeros(2 * blocks, dtype=torch.int32)
        self.status = torch.zeros(1, dtype=torch.int32)

    def barrier(self, pads, pid, epoch, timeout_ns, status_ptr, RANK, WORLD, SERIAL):
        b, e = int(pid.handle.data.reshape(-1)[0]), int(epoch.handle.data.reshape(-1)[0])
        w, r = self.world, self.rank
        for p in range(w):
            if p != r:
                self.pads[p][b * w + r] = e
        deadline = time.monotonic() + 60
        for p in range(w):
            while p != r and int(self.pads[r][b * w + p]) - e < 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} block {b}: rank {p} never reached epoch {e}")
                time.sleep(0)

    def __call__(self, name, x, out, segment=()):
        K = self.K
        elsize = x.element_size()
        block = self.num_warps * 32 * (16 // elsize)
        unit = block * (self.world if name == "two_shot" else 1)
        active = max(1, min(self.blocks, -(-x.numel() // unit)))
        views = tuple(b.view(x.dtype) for b in self.bufs)
        extra = {"PULL": self.pull} if name == "two_shot" else {}
        getattr(K, f"{name}_kernel")[(self.blocks,)](
            x, out, x.numel(), active, *segment, views, self.pads, self.state,
            self.status.data_ptr(), 10 ** 9, views[0].numel() // 2,
            RANK=self.rank, WORLD=self.world, BLOCK=block, SERIAL=self.serial,
            num_warps=self.num_warps, **extra)


def _data(rank: int, n: int, dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(salt * 7919 + rank * 31 + n)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def _plan(world: int):
    """(name, n, dtype) calls in a row: sizes below, at and above one block's pass, odd sizes,
    every kernel, repeated so both halves and the counters wrap through several uses."""
    calls = []
    sizes = (1, 7, 129, 256, 1000, 4099)
    for i in range(3):
        for n in sizes:
            calls.append(("one_shot", n, (torch.float32, torch.bfloat16)[(i + n) % 2]))
            calls.append(("two_shot", n, (torch.float16, torch.float32)[(i + n) % 2]))
        calls.append(("all_gather", 77 + 900 * i, torch.float32))
        calls.append(("reduce_scatter", 3001 + i, torch.float32))
    return calls


def _run_rank(rank, world, shared, results, blocks, num_warps, serial, pull):
    """Child process: every call of the plan; results[i] = 1 where call i was exact."""
    from layer2_comm import peer_kernels as K

    me = _Rank(rank, world, shared["bufs"], shared["pads"], blocks, num_warps,
               shared["bufs"][0].numel(), serial, pull)
    K._barrier = me.barrier  # the interpreter looks the name up at call time
    for i, (name, n, dtype) in enumerate(_plan(world)):
        if os.environ.get("PEER_DEBUG"):
            print(f"rank {rank} call {i} {name} {n} {dtype}", flush=True)
        xs = [_data(r, n, dtype, i) for r in range(world)]
        x = xs[rank]
        if name in ("one_shot", "two_shot"):
            out = torch.empty_like(x)
            me(name, x, out)
            want = torch.stack([v.float() for v in xs]).sum(0).to(dtype)
        elif name == "all_gather":
            out = torch.empty(world * n, dtype=dtype)
            me(name, x, out)
            want = torch.cat(xs)
        else:
            lo = (n // world) * rank + min(rank, n % world)
            hi = lo + n // world + (1 if rank < n % world else 0)
            out = torch.empty(hi - lo, dtype=dtype)
            me(name, x, out, (lo, hi))
            want = torch.stack(xs).sum(0)[lo:hi]
        results[rank, i] = int(torch.equal(out, want))


@pytest.mark.parametrize("world,blocks,num_warps,serial,pull", [
    (2, 4, 1, False, True),
    (3, 3, 1, False, True),
    (4, 4, 1, False, True),
    (4, 2, 1, True, False),
])
def test_kernels_equal_the_exact_sum_on_simulated_ranks(world, blocks, num_warps, serial, pull):
    from layer2_comm import peer_kernels as K

    if not _interpreted(K):
        pytest.skip("peer_kernels was compiled, not interpreted, in this process")
    # two halves of 32 KiB per rank (the plan's largest message is 4099 x 4 bytes)
    shared = {
        "bufs": [torch.zeros(2 * 32768, dtype=torch.uint8).share_memory_() for _ in range(world)],
        "pads": [torch.zeros(blocks * world, dtype=torch.int32).share_memory_()
                 for _ in range(world)],
    }
    results = torch.zeros(world, len(_plan(world)), dtype=torch.int32).share_memory_()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the child: one rank; never returns into pytest
            code = 0
            try:
                _run_rank(rank, world, shared, results, blocks, num_warps, serial, pull)
            except BaseException as exc:  # noqa: BLE001
                print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    assert codes == [0] * world, codes
    plan = _plan(world)
    bad = [f"rank {r}: call {i} {plan[i][0]} n={plan[i][1]} {plan[i][2]}"
           for r in range(world) for i in range(len(plan)) if not results[r, i]]
    assert not bad, "\n".join(bad[:20])
