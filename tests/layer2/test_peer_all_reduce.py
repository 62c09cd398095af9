"""One-shot / two-shot all-reduce: the simulated algorithms on CPU, our kernels on GPUs.

CPU: the simulated ranks give the exact sum, move the bytes the cost model says, take the
barriers they should, and a version without a barrier is caught as a race.
GPUs (multigpu): PeerAllReduce equals NCCL's all_reduce for fp32 / bf16 / fp16, odd sizes,
both algorithms, inside a captured CUDA graph replayed many times (flag and buffer reuse bugs
show only on repetition), on every visible GPU (any world size); bad input raises clearly.
"""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from layer2_comm import (
    PeerAllReduce,
    PeerBuffers,
    RaceError,
    launch,
    one_shot_all_reduce,
    segment_bounds,
    two_shot_all_reduce,
)
from layer2_comm.cost_model import AlphaBeta, predict

from .peer_checks import assert_every_rank_passes, exact_ints, nccl_sum, visible_gpus

ALGOS = {"one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce}


def _inputs(world: int, n: int, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]


@pytest.mark.parametrize("name", sorted(ALGOS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 1003])
def test_simulated_algorithms_sum_exactly_and_agree(name, world, n):
    xs = _inputs(world, n, seed=world * 100 + n)
    outs = ALGOS[name](xs)
    want = torch.stack(xs).sum(0) if n else torch.zeros(0)
    for out in outs:
        assert out.shape == xs[0].shape
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, outs[0])  # the same bits on every rank


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_simulated_low_precision_accumulates_in_fp32(dtype):
    xs = _inputs(4, 257, dtype)
    want = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
    for fn in ALGOS.values():
        assert all(torch.equal(out, want) for out in fn(xs))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_simulated_traffic_and_barriers_match_the_cost_model(world):
    n = 1000
    bufs = PeerBuffers(world, n)
    one_shot_all_reduce(_inputs(world, n), bufs)
    assert bufs.barriers == 1
    assert bufs.remote_read == [(world - 1) * n] * world and bufs.remote_written == [0] * world
    bufs = PeerBuffers(world, n)
    two_shot_all_reduce(_inputs(world, n), bufs)
    assert bufs.barriers == 2
    seg = [b - a for a, b in segment_bounds(n, world)]
    assert bufs.remote_read == [(world - 1) * s for s in seg]
    assert bufs.remote_written == [(world - 1) * s for s in seg]
    ab = AlphaBeta(1e-6, 1e-9)  # the model's bandwidth terms count the same bytes
    assert predict("one_shot_all_reduce", n, world, ab) == pytest.approx(1e-6 + (world - 1) * n * 1e-9)
    assert predict("two_shot_all_reduce", n, world, ab) == pytest.approx(
        2e-6 + 2 * (world - 1) / world * n * 1e-9)


def test_a_missing_barrier_is_a_race():
    bufs = PeerBuffers(2, 4)
    bufs.write(0, 0, 0, torch.ones(4))
    with pytest.raises(RaceError, match="rank 1 reads rank 0's buffer"):
        bufs.read(1, 0, 0, 4)
    bufs.barrier()
    bufs.read(1, 0, 0, 4)
    with pytest.raises(RaceError, match="rank 0 writes rank 0's buffer"):
        bufs.write(0, 0, 0, torch.zeros(4))  # rank 1 is still reading it in this phase


def test_simulated_bad_input_is_named():
    with pytest.raises(ValueError, match="rank 1 passed"):
        one_shot_all_reduce([torch.ones(3), torch.ones(4)])
    with pytest.raises(ValueError, match="do not fit"):
        two_shot_all_reduce(_inputs(2, 10), PeerBuffers(2, 5))
    with pytest.raises(ValueError, match="outside a buffer"):
        PeerBuffers(2, 4).read(0, 1, 0, 5)


def test_peer_switches_read_0_or_1_and_name_anything_else(monkeypatch):
    from layer1_kernels import env_switch
    from layer2_comm.peer_all_reduce import PDL_ENV

    monkeypatch.delenv(PDL_ENV, raising=False)
    assert env_switch(PDL_ENV, True) and not env_switch(PDL_ENV, False)
    for value, on in (("1", True), ("0", False)):
        monkeypatch.setenv(PDL_ENV, value)
        assert env_switch(PDL_ENV, not on) is on
    for bad in ("off", "", "yes", "2"):
        monkeypatch.setenv(PDL_ENV, bad)
        with pytest.raises(ValueError, match=f"{PDL_ENV} must be 0 or 1, got {bad!r}"):
            env_switch(PDL_ENV, True)


def test_peer_all_reduce_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the multigpu tests run the real thing")
    with pytest.raises(RuntimeError, match="needs CUDA peer access"):
        PeerAllReduce()


# ---- GPUs ----------------------------------------------------------------------------
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gpu_checks() -> list[str]:
    """Every check on this rank; returns what failed (empty: all passed)."""
    bad: list[str] = []
    ar = PeerAllReduce(max_bytes=1 << 20, debug=True, timeout_s=10.0)
    world = dist.get_world_size()
    sizes = (1, 7, 1000, 4097, 65537, (1 << 20) // 4)
    for dtype in DTYPES:
        for n in sizes:
            for algo in ("one_shot", "two_shot"):
                x = exact_ints(n, dtype, 1)
                ar.one_shot_max_bytes = 1 << 40 if algo == "one_shot" else 0
                got = ar(x)
                if not torch.equal(got, nccl_sum(x)):
                    bad.append(f"{algo} {dtype} n={n}: differs from NCCL")
    # random normals (not exact): close to NCCL, identical on every rank
    ar.one_shot_max_bytes = 256 << 10
    for n in (12345, 200_000):
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        got = ar(x)
        if not torch.allclose(got.float(), nccl_sum(x).float(), rtol=2e-2, atol=2e-2 * world):
            bad.append(f"randn bf16 n={n}: not close to NCCL")
        gathered = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(gathered, got)
        if not all(torch.equal(g, got) for g in gathered):
            bad.append(f"randn bf16 n={n}: ranks disagree")
    # repetition: many calls back to back, sizes and algorithms interleaved, no host sync
    ar.debug = False
    results = []
    for i in range(300):
        n = (37, 5000, 70001)[i % 3]
        ar.one_shot_max_bytes = 1 << 40 if i % 2 else 0
        x = exact_ints(n, torch.float32, 100 + i)
        results.append((x, ar(x), i))
    for x, got, i in results:
        if not torch.equal(got, nccl_sum(x)):
            bad.append(f"repeated call {i} (n={x.numel()}): differs from NCCL")
            break
    ar.debug = True
    # all-gather and reduce-scatter through the same buffers, interleaved with all-reduces
    for i, n in enumerate((1, 7, 1000, 4097, 65537)):
        for dtype in DTYPES:
            x = exact_ints(n, dtype, 500 + i)
            want = torch.empty(world * n, device="cuda", dtype=dtype)
            dist.all_gather_into_tensor(want, x)
            if not torch.equal(ar.all_gather(x), want):
                bad.append(f"all_gather {dtype} n={n}: differs from NCCL")
            # uneven segments, within the registered 1 MiB at any world size
            y = exact_ints(min(n * world + world - 1, (1 << 18) - 1), dtype, 600 + i)
            mine = torch.tensor_split(nccl_sum(y), world)[dist.get_rank()]
            if not torch.equal(ar.reduce_scatter(y), mine):
                bad.append(f"reduce_scatter {dtype} n={y.numel()}: differs from NCCL")
            if not torch.equal(ar(x), nccl_sum(x)):
                bad.append(f"all-reduce after gather/scatter {dtype} n={n}: differs")
    if ar.all_gather(exact_ints(3, torch.float32, 9).view(3, 1)).shape != (3 * world, 1):
        bad.append("all_gather: wrong shape")
    # a 2-D, non-contiguous input and an out= tensor
    x = exact_ints(64 * 33, torch.float16, 3).view(64, 33).t()
    out = torch.empty(33, 64, device="cuda", dtype=torch.float16)
    if ar(x, out) is not out or not torch.equal(out, nccl_sum(x.contiguous())):
        bad.append("non-contiguous input with out=: wrong")
    # larger than the buffer: NCCL takes it
    big = exact_ints((1 << 20) // 2 + 3, torch.float32, 4)
    if ar.algorithm(big.numel() * 4) != "nccl" or not torch.equal(ar(big), nccl_sum(big)):
        bad.append("above max_bytes: not NCCL's result")
    bad += _graph_checks(ar)
    ar.check()
    ar.close()
    return bad


def _graph_checks(ar: PeerAllReduce) -> list[str]:
    """Capture one-shot and two-shot calls in one CUDA graph; replay with fresh inputs."""
    bad = []
    ar.debug = False
    ar.one_shot_max_bytes = 8 << 10
    small = torch.zeros(1000, device="cuda", dtype=torch.bfloat16)  # one-shot
    large = torch.zeros(200_001, device="cuda", dtype=torch.float32)  # two-shot
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        ar(small), ar(large), ar.all_gather(small), ar.reduce_scatter(large)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_small = ar(small)
        out_large = ar(large)
        out_small2 = ar(out_small)  # the sum of the sums: W * sum
        gathered = ar.all_gather(small)
        scattered = ar.reduce_scatter(large)
    world = dist.get_world_size()
    for i in range(200):
        small.copy_(exact_ints(small.numel(), torch.bfloat16, 1000 + i))
        large.copy_(exact_ints(large.numel(), torch.float32, 2000 + i))
        graph.replay()
        want_small = nccl_sum(small)
        if not (torch.equal(out_small, want_small) and torch.equal(out_large, nccl_sum(large))
                and torch.equal(out_small2, want_small * world)
                and torch.equal(scattered, torch.tensor_split(nccl_sum(large), world)[dist.get_rank()])
                and torch.equal(gathered, _gathered(small))):
            bad.append(f"CUDA graph replay {i}: differs from NCCL")
            break
    ar.debug = True
    return bad


def _gathered(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(dist.get_world_size() * x.numel())
    dist.all_gather_into_tensor(out, x)
    return out


def _mismatch() -> str:
    ar = PeerAllReduce(max_bytes=1 << 16, debug=True, timeout_s=10.0)
    n = 100 + dist.get_rank()
    try:
        ar(torch.ones(n, device="cuda"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _absent_peer() -> str:
    ar = PeerAllReduce(max_bytes=1 << 16, timeout_s=1.0)
    if dist.get_rank() == 0:
        start = time.monotonic()
        ar(torch.ones(100, device="cuda"))
        try:
            ar.check()
        except RuntimeError as exc:
            return f"{time.monotonic() - start:.1f}s {exc}"
        return "no error"
    time.sleep(4.0)  # never calls
    return "absent"


def _after_a_rendezvous_of_rank_0_alone() -> bool:
    """Torch counts symmetric-memory store exchanges per process: rank 0 rendezvousing alone
    first (as a process that hosted an earlier engine) puts it ahead of the others."""
    import torch.distributed._symmetric_memory as symm_mem

    alone = dist.new_group([0])  # collective: every rank makes it, only rank 0 uses it
    if dist.get_rank() == 0:
        earlier = symm_mem.empty(64, device="cuda")
        symm_mem.rendezvous(earlier, alone.group_name)
    ar = PeerAllReduce(max_bytes=1 << 16, timeout_s=10.0)
    x = exact_ints(1000, torch.float32, 5)
    ok = torch.equal(ar(x), nccl_sum(x))
    ar.close()
    return ok


@pytest.mark.multigpu
def test_peer_all_reduce_equals_nccl_everywhere():
    assert_every_rank_passes(_gpu_checks, timeout_s=300)


@pytest.mark.multigpu
def test_peer_all_reduce_meets_when_one_rank_rendezvoused_before():
    assert all(launch(_after_a_rendezvous_of_rank_0_alone, visible_gpus(), backend="nccl",
                      timeout_s=40))


@pytest.mark.multigpu
def test_peer_all_reduce_names_mismatched_ranks():
    messages = launch(_mismatch, visible_gpus(), backend="nccl", timeout_s=120)
    assert all("rank 1 passed 101" in m or "rank 0 passed 100" in m for m in messages), messages


@pytest.mark.multigpu
def test_peer_all_reduce_times_out_on_an_absent_rank():
    messages = launch(_absent_peer, visible_gpus(), backend="nccl", timeout_s=120)
    # any absent peer may be the first rank 0's barrier finds missing
    missing = re.search(r"waiting for rank (\d+)", messages[0])
    assert missing and 0 < int(missing.group(1)) < len(messages), messages
    assert "timed out" in messages[0], messages
    assert float(messages[0].split("s ")[0]) < 10.0


def test_peer_report_knob_table_from_rows():
    """The bench's knob rows become one markdown row per size and algorithm (no GPU needed)."""
    from layer2_comm.bench_peer import summarize
    from layer2_comm.peer_report import knob_lines, markdown

    rows = []
    for size in (8 << 10, 512 << 10):
        for impl, t in (("ours one_shot", 6e-6), ("ours two_shot", 8e-6),
                        ("ours (by size)", 6e-6), ("NCCL", 15e-6),
                        ("torch symm_mem two_shot", 7e-6)):
            rows.append({"impl": impl, "bytes": size, "time_s": t * (1 + size / (1 << 20)),
                         "busbw": 1e9, "ok": True, "error": None})
        for knob, t in (("defaults", 6e-6), ("serial barrier", 8e-6), ("8 warps", None)):
            rows.append({"impl": f"knob {knob} one_shot", "knob": knob, "algorithm": "one_shot",
                         "bytes": size, "time_s": t or float("nan"), "ok": t is not None,
                         "error": None if t else "OutOfResources: x", "active": 1})
    for kind in ("all_gather", "reduce_scatter"):
        for impl in ("ours", "NCCL"):
            rows.append({"impl": f"{impl} {kind}", "bytes": 256 << 20, "time_s": 1e-3,
                         "busbw": 3e11, "ok": True, "error": None})
    lines = knob_lines(rows)
    assert lines[0].startswith(
        "| size | algorithm | active blocks | defaults (us) | serial barrier (us)")
    want = "| 8 KiB | one_shot | 1 | 6.0 | 8.0 | error | 15.1 | 7.1 |"
    assert lines[2].startswith(want), lines[2]
    assert any("knob 8 warps one_shot" in line and "OutOfResources" in line for line in lines)
    text = markdown(rows, summarize(rows, 4))
    assert "Knobs, one at a time" in text and lines[2] in text


class _FakePeer:
    """Stands in for PeerAllReduce on CPU ranks (gloo): `_launch` all-reduces with gloo, so the
    bench's knob sweep runs its Python (knobs set and restored, the wide instance built and
    closed collectively, correctness agreed across ranks) without a GPU."""

    made: list = []

    def __init__(self, max_bytes=8 << 20, device=None, blocks=None, **_):
        self.max_bytes, self.blocks = max_bytes, blocks or (64 if max_bytes <= 8 << 20 else 128)
        self.num_warps, self.serial_barrier, self.pull_gather = 16, False, True
        self.closed = False
        _FakePeer.made.append(self)

    def active_blocks(self, name, numel, elsize):
        pieces = dist.get_world_size() if name == "two_shot" else 1
        unit = self.num_warps * 32 * (16 // elsize) * pieces
        return max(1, min(self.blocks, -(-numel // unit)))

    def _launch(self, x, out, name):
        if self.num_warps == 32 and self.max_bytes > 8 << 20:
            raise RuntimeError("out of resources (a knob that fails is reported, not fatal)")
        out.copy_(x)
        dist.all_reduce(out)

    def close(self):
        self.closed = True


# The sweep's largest size, eager and above the small instance's buffer like the bench's 256 MiB
# (gloo all-reducing 256 MiB on CPU ranks for every knob took most of this test's time).
LARGE = 16 << 20


def _knob_sweep_on_cpu_rank():
    from layer2_comm import bench_peer

    bench_peer.PeerAllReduce = _FakePeer
    bench_peer._graph_time = lambda call, per_graph, iters, dev: (call(), 5e-6)[1]
    bench_peer.time_collective = lambda call, iters, warmup, dev: [(call(), 1e-3)[1]] * iters
    assert bench_peer.KNOB_SIZES[-1] == (256 << 20, "two_shot")
    bench_peer.KNOB_SIZES = [*bench_peer.KNOB_SIZES[:-1], (LARGE, "two_shot")]
    small, large = _FakePeer(), _FakePeer(max_bytes=LARGE)
    rows = bench_peer._knob_rows(small, large, 3, torch.float32, torch.device("cpu"), 2)
    wide = [p for p in _FakePeer.made if p.blocks == 2 * large.blocks]
    return rows, (small.num_warps, small.serial_barrier, large.pull_gather), \
        [p.closed for p in wide]


@pytest.mark.usefixtures("fork_server")
def test_peer_bench_knob_sweep_runs_on_cpu_ranks():
    results = launch(_knob_sweep_on_cpu_rank, 2, backend="gloo", timeout_s=120)
    rows, restored, wide_closed = results[0]
    assert restored == (16, False, True)  # every knob put back
    assert wide_closed == [True]  # the 2x-blocks instance: built once, closed
    by = {(r["knob"], r["bytes"], r["algorithm"]): r for r in rows}
    small_default = by[("defaults", 8 << 10, "one_shot")]
    assert small_default["ok"] and small_default["active"] == 1
    assert ("push gather", 8 << 10, "one_shot") not in by  # two-shot only
    assert ("2x blocks", 2 << 20, "two_shot") not in by  # the large instance only
    assert by[("2x blocks", LARGE, "two_shot")]["blocks"] == 256
    assert by[("defaults", LARGE, "two_shot")]["timing"] == "eager"
    assert by[("defaults", 8, "one_shot")]["bytes"] == 8
    assert all(r["ok"] for r in rows if r["error"] is None)
    failed = by[("32 warps", LARGE, "two_shot")]
    assert "out of resources" in failed["error"] and failed["time_s"] != failed["time_s"]
