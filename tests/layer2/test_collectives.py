"""Each collective built from send/recv equals torch.distributed's built-in.

One launched job per world size (2, 3, 4 gloo ranks) runs every check — collectives x
sizes (0, 1, world-1, 1000, 1003: not multiples of the world size) x float32 (allclose)
and int64 (exact) x ops x chunk counts — and returns {check: None or the error}, because
spawning ranks costs seconds and checking costs milliseconds. While our collective runs,
torch.distributed's own collectives are replaced by functions that raise, so a check
cannot pass by calling the library.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from layer2_comm import (
    all_to_all,
    broadcast_chain,
    broadcast_tree,
    device,
    hierarchical_all_reduce,
    launch,
    rank,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    segment_bounds,
    tree_all_reduce,
    tuning,
    world_size,
)

BUILTINS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
            "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "reduce",
            "gather", "scatter", "barrier", "all_gather_object", "broadcast_object_list")
DTYPES = (torch.float32, torch.int64)


@contextmanager
def only_point_to_point():
    """torch.distributed's collectives raise inside this block; isend/irecv still work."""
    saved = {name: getattr(dist, name) for name in BUILTINS if hasattr(dist, name)}

    def refuse(name: str) -> Callable:
        def refused(*args, **kwargs):
            raise AssertionError(f"the collective called torch.distributed.{name}")
        return refused

    for name in saved:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def make_input(n: int, dtype: torch.dtype, who: int, salt: int) -> torch.Tensor:
    """Deterministic per (rank, size, salt): random normals, or integers in [-1000, 1000)."""
    g = torch.Generator().manual_seed(salt * 1_000_003 + who * 7919 + n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g, dtype=dtype)
    else:
        x = torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)
    return x.to(device())


def same(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return False
    if ref.dtype.is_floating_point:
        return torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    return torch.equal(ours, ref)


def ref_all_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return out / world_size() if op == "avg" else out


def ref_all_gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def identical_everywhere(x: torch.Tensor) -> bool:
    """True when every rank holds bit-identical values."""
    return torch.equal(ref_all_gather(x.reshape(-1)).view(world_size(), -1),
                       x.reshape(1, -1).expand(world_size(), -1))


def run_checks() -> dict[str, str | None]:
    """Every check on this rank: {name: None if it passed, else what went wrong}."""
    p, me = world_size(), rank()
    report: dict[str, str | None] = {}

    def check(name: str, body: Callable[[], bool]) -> None:
        try:
            report[name] = None if body() else "differs from torch.distributed"
        except Exception as exc:
            report[name] = f"{type(exc).__name__}: {exc}"

    def expect(name: str, ref: torch.Tensor, fn: Callable, *args, **kwargs) -> None:
        """Check that our fn(*args, **kwargs), run on point-to-point alone, gives `ref`."""
        def body() -> bool:
            with only_point_to_point():
                ours = fn(*args, **kwargs)
            return same(ours, ref)
        check(name, body)

    sizes = sorted({0, 1, p - 1, 1000, 1003})
    for n in sizes:
        for dtype in DTYPES:
            x = make_input(n, dtype, me, 1)
            ops = ("sum", "max", "avg") if dtype.is_floating_point else ("sum", "max")
            for op in ops:
                ref = ref_all_reduce(x, op)
                tag = f"n={n} {dtype} {op}"
                for chunks in (1, 3):
                    expect(f"ring_all_reduce {tag} chunks={chunks}", ref,
                           ring_all_reduce, x.clone(), op, chunks=chunks)
                    expect(f"ring_reduce_scatter {tag} chunks={chunks}", ref.tensor_split(p)[me],
                           ring_reduce_scatter, x, op, chunks=chunks)
                expect(f"tree_all_reduce {tag}", ref, tree_all_reduce, x.clone(), op)
                expect(f"hierarchical_all_reduce {tag} ranks_per_node=2", ref,
                       hierarchical_all_reduce, x.clone(), 2, op)
            for chunks in (1, 2):
                expect(f"ring_all_gather n={n} {dtype} chunks={chunks}", ref_all_gather(x),
                       ring_all_gather, x, chunks=chunks)
            for src in sorted({0, p - 1}):
                ref = x.clone()
                dist.broadcast(ref, src)
                expect(f"broadcast_tree n={n} {dtype} src={src}", ref, broadcast_tree, x.clone(), src)
                for chunks in (1, 4):
                    expect(f"broadcast_chain n={n} {dtype} src={src} chunks={chunks}", ref,
                           broadcast_chain, x.clone(), src, chunks=chunks)

    # Every grouping into nodes, including a last node smaller than the others.
    x = make_input(1003, torch.float32, me, 2)
    for per_node in sorted({1, 2, 3, p, p + 1}):
        for op in ("sum", "max", "avg"):
            expect(f"hierarchical_all_reduce ranks_per_node={per_node} {op}", ref_all_reduce(x, op),
                   hierarchical_all_reduce, x.clone(), per_node, op)

    # Uneven all-to-all, zero rows included; splits[i][j] = rows rank i sends to rank j.
    g = torch.Generator().manual_seed(3)
    splits = torch.randint(0, 4, (p, p), generator=g).tolist()
    for dtype in DTYPES:
        for rest in ((), (3,)):
            rows = sum(splits[me])
            x = make_input(rows * (rest[0] if rest else 1), dtype, me, 4).view(rows, *rest)
            ref = x.new_empty((sum(splits[j][me] for j in range(p)), *rest))
            dist.all_to_all_single(ref, x, [splits[j][me] for j in range(p)], splits[me])
            expect(f"all_to_all {dtype} rows of shape {rest}", ref, all_to_all, x, splits[me])

    # Results are bit-identical on every rank, not just close to the reference.
    x = make_input(1003, torch.float32, me, 5)
    for name, fn in (("ring_all_reduce", lambda t: ring_all_reduce(t, chunks=2)),
                     ("tree_all_reduce", tree_all_reduce),
                     ("hierarchical_all_reduce", lambda t: hierarchical_all_reduce(t, 2))):
        with only_point_to_point():
            out = fn(x.clone())
        check(f"{name} bit-identical on every rank", lambda out=out: identical_everywhere(out))

    # Striped over 2 lanes (every message, however small) and pipelined in pieces chosen by
    # size (1 KiB pieces: several per segment): the transport the GPU defaults use, checked here.
    with tuning.override(lanes=2, stripe_min_bytes=0, chunk_bytes=1024):
        for dtype in DTYPES:
            x = make_input(2501, dtype, me, 9)
            ref = ref_all_reduce(x, "sum")
            expect(f"lanes=2 ring_all_reduce {dtype}", ref, ring_all_reduce, x.clone())
            expect(f"lanes=2 ring_reduce_scatter {dtype}", ref.tensor_split(p)[me], ring_reduce_scatter, x)
            expect(f"lanes=2 ring_all_gather {dtype}", ref_all_gather(x), ring_all_gather, x)
            expect(f"lanes=2 tree_all_reduce {dtype}", ref, tree_all_reduce, x.clone())
            expect(f"lanes=2 hierarchical_all_reduce {dtype}", ref, hierarchical_all_reduce, x.clone(), 2)
            ref_b = x.clone()
            dist.broadcast(ref_b, p - 1)
            expect(f"lanes=2 broadcast_chain {dtype}", ref_b, broadcast_chain, x.clone(), p - 1)
            rows = [(3 * me + 5 * j) % 4 for j in range(p)]
            a2a = make_input(sum(rows) * 3, dtype, me, 10).view(-1, 3)
            want = a2a.new_empty((sum((3 * j + 5 * me) % 4 for j in range(p)), 3))
            dist.all_to_all_single(want, a2a, [(3 * j + 5 * me) % 4 for j in range(p)], rows)
            expect(f"lanes=2 all_to_all {dtype}", want, all_to_all, a2a, rows)

    # Shapes: non-contiguous and 0-d tensors are reduced in place; all-gather stacks dim 0.
    base = make_input(30, torch.float32, me, 6).view(6, 5)
    y, ref = base.t(), ref_all_reduce(base, "sum").t()
    expect("ring_all_reduce non-contiguous", ref, ring_all_reduce, y)
    check("ring_all_reduce non-contiguous: in place", lambda: same(y, ref))
    z = make_input(1, torch.float32, me, 7).view(())
    expect("tree_all_reduce 0-d", ref_all_reduce(z, "sum"), tree_all_reduce, z.clone())
    m = make_input(6, torch.int64, me, 8).view(2, 3)
    expect("ring_all_gather 2-d -> (2p, 3)", ref_all_gather(m.reshape(-1)).view(2 * p, 3),
           ring_all_gather, m)
    return report


def failures(reports: list[dict[str, str | None]]) -> list[str]:
    return [f"rank {r}: {name}: {err}" for r, rep in enumerate(reports)
            for name, err in rep.items() if err is not None]


@pytest.mark.usefixtures("fork_server")  # 9 ranks
@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_torch_distributed(world: int):
    reports = launch(run_checks, world, backend="gloo", timeout_s=60)
    bad = failures(reports)
    assert not bad, f"{len(bad)} checks failed:\n" + "\n".join(bad[:40])
    assert len(reports[0]) > 150 and all(rep.keys() == reports[0].keys() for rep in reports)


@pytest.mark.multigpu
def test_collectives_match_torch_distributed_nccl():
    world = min(torch.cuda.device_count(), 4)
    reports = launch(run_checks, world, backend="nccl", timeout_s=180)
    bad = failures(reports)
    assert not bad, f"{len(bad)} checks failed:\n" + "\n".join(bad[:40])


@pytest.mark.parametrize("n", [0, 1, 3, 7, 1000, 1003])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_segment_bounds_cut_like_tensor_split(n: int, parts: int):
    sizes = [b - a for a, b in segment_bounds(n, parts)]
    assert sizes == [len(t) for t in torch.arange(n).tensor_split(parts)]
    assert segment_bounds(n, parts)[-1][1] == n
