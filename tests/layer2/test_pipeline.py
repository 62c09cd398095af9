"""The pipelined ring, lanes, the header check and the tuning knobs.

- the pipelined ring at awkward sizes and piece counts (more pieces than elements, pieces
  that do not divide segments, explicit and size-chosen), on 2, 3 and 4 gloo ranks, equal
  *exactly* to torch.distributed on integer-valued data (float32 holding integers, int64);
- striping over lanes (a message cut over 1, 2 and 3 process groups) gives the same bits;
- check=False skips the header but not the answer; the header round is one round;
- run_pipeline never issues an item before the item it depends on is finished;
- tuning: defaults, environment, override, validation; the tune command and the
  session summary on gloo.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from layer2_comm import (
    commands,
    hierarchical_all_reduce,
    launch,
    p2p,
    rank,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    tuning,
    world_size,
)
from layer2_comm.ring import Stage, run_pipeline
from tests.benchmark_script import load

# 11 ranks and the tune command's: these tests are about the ring, not how ranks start
pytestmark = pytest.mark.usefixtures("fork_server_module")


def integers(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Integer values in [-1000, 1000), per rank: sums are exact in float32 too."""
    g = torch.Generator().manual_seed(salt * 7919 + rank() * 104_729 + n)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def exact_checks() -> dict[str, str | None]:
    """Every rank: {case: None if ours == torch.distributed bit for bit, else what differed}."""
    p, me = world_size(), rank()
    report: dict[str, str | None] = {}

    def same(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
        ok = ours.dtype == ref.dtype and ours.shape == ref.shape and torch.equal(ours, ref)
        report[name] = None if ok else f"differs: {ours[:5].tolist()} vs {ref[:5].tolist()}"

    cases = [(n, chunks) for n in (1, p - 1, p + 1, 37, 1001)
             for chunks in (1, 2, 5, 64)]  # 64 pieces: more than some segments have elements
    for dtype in (torch.float32, torch.int64):
        for n, chunks in cases:
            x = integers(n, dtype, 1)
            for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                ref = x.clone()
                dist.all_reduce(ref, op=reduce_op)
                tag = f"n={n} {dtype} {op} chunks={chunks}"
                same(f"all_reduce {tag}", ring_all_reduce(x.clone(), op, chunks=chunks), ref)
                same(f"reduce_scatter {tag}", ring_reduce_scatter(x, op, chunks=chunks), ref.tensor_split(p)[me])
            parts = [torch.empty_like(x) for _ in range(p)]
            dist.all_gather(parts, x)
            same(f"all_gather n={n} {dtype} chunks={chunks}", ring_all_gather(x, chunks=chunks), torch.cat(parts))
    # Pieces chosen from the size: 256-byte pieces cut a 4 KiB segment into 16, capped at 5.
    x = integers(4099, torch.float32, 2)
    ref = x.clone()
    dist.all_reduce(ref)
    with tuning.override(chunk_bytes=256, max_pieces=5) as t:
        assert t.pieces(4099 // p * 4) == 5
        same("all_reduce, pieces by size", ring_all_reduce(x.clone()), ref)
        same("hierarchical, pieces by size", hierarchical_all_reduce(x.clone(), 1), ref)
    # Lanes: every message cut over 1, 2 and 3 groups (lanes made on first use, in order).
    for lanes in (1, 2, 3):
        with tuning.override(lanes=lanes, stripe_min_bytes=0, chunk_bytes=1024):
            same(f"all_reduce lanes={lanes}", ring_all_reduce(x.clone()), ref)
            same(f"reduce_scatter lanes={lanes}", ring_reduce_scatter(x), ref.tensor_split(p)[me])
    # No header check: same answer, and no header round (counted below).
    with tuning.override(check=False):
        same("all_reduce check=False", ring_all_reduce(x.clone()), ref)
        same("all_reduce check=False avg", ring_all_reduce(x.clone(), "avg"), ref / p)
    return report


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_ring_equals_torch_distributed_exactly(world: int):
    reports = launch(exact_checks, world, backend="gloo", timeout_s=90)
    bad = [f"rank {r}: {name}: {err}" for r, rep in enumerate(reports) for name, err in rep.items() if err]
    assert not bad, "\n".join(bad[:30])
    assert len(reports[0]) > 100


def count_header_rounds() -> tuple[int, int]:
    """(header rounds with the check on, with it off) for one all-reduce on this rank."""
    calls = []
    original = p2p.exchange_headers

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    p2p.exchange_headers = counting
    try:
        ring_all_reduce(torch.ones(1000))
        on = len(calls)
        with tuning.override(check=False):
            ring_all_reduce(torch.ones(1000))
        return on, len(calls) - on
    finally:
        p2p.exchange_headers = original


def test_the_header_is_one_round_and_check_false_skips_it():
    assert launch(count_header_rounds, 2, backend="gloo", timeout_s=30) == [(1, 0), (1, 0)]


def test_run_pipeline_issues_an_item_only_after_its_predecessor_is_finished():
    events: list[tuple[str, int]] = []

    class Done:
        def wait(self) -> None:
            pass

    def stage(offset: int, count: int) -> Stage:
        def issue(j: int, tag: int) -> Done:
            assert tag == offset + j + 100  # tags number the items across stages
            events.append(("issue", offset + j))
            return Done()
        return Stage(count, issue, lambda j: events.append(("finish", offset + j)))

    depth = 3
    run_pipeline([stage(0, 7), stage(7, 5)], depth=depth, tag=100)
    issued = [i for kind, i in events if kind == "issue"]
    finished = [i for kind, i in events if kind == "finish"]
    assert issued == list(range(12)) and finished == list(range(12))
    for i in range(depth, 12):  # item i - depth finished before item i was issued ...
        assert events.index(("finish", i - depth)) < events.index(("issue", i))
    for i in range(1, depth):  # ... and up to `depth` items in flight: 1 and 2 go before 0 ends
        assert events.index(("issue", i)) < events.index(("finish", 0))


def test_stripe_cuts_a_message_like_segment_bounds():
    x = torch.arange(10.0)
    assert [t.tolist() for t in p2p.stripe(x, 3, 0)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert p2p.stripe(x, 3, 41)[0] is x  # 40 bytes: below the threshold, one part
    assert [t.numel() for t in p2p.stripe(x[:2], 3, 0)] == [1, 1, 0]
    assert p2p.stripe(x, 3, 0)[1].data_ptr() == x.data_ptr() + 4 * 4  # views, not copies


def test_tuning_defaults_environment_and_override(monkeypatch):
    nccl, gloo = tuning.current("nccl"), tuning.current("gloo")
    assert nccl.lanes >= 2 and gloo.lanes == 1 and nccl.check and gloo.check
    assert nccl.pieces(128 << 20) == 4 and nccl.pieces(1) == 1 and nccl.pieces(1 << 40) == nccl.max_pieces
    monkeypatch.setenv("LLM_STACK_L2_LANES", "3")
    monkeypatch.setenv("LLM_STACK_L2_CHECK", "0")
    assert tuning.current("gloo").lanes == 3 and tuning.current("gloo").check is False
    with tuning.override(lanes=1, chunk_bytes=10) as t:
        assert t.lanes == 1 and t.chunk_bytes == 10 and tuning.current("gloo").lanes == 1
        with tuning.override(lanes=5):
            assert tuning.current("gloo") == tuning.Tuning(10, gloo.max_pieces, 5, gloo.stripe_min_bytes, False)
    assert tuning.current("gloo").lanes == 3
    monkeypatch.setenv("LLM_STACK_L2_LANES", "two")
    with pytest.raises(ValueError, match="LLM_STACK_L2_LANES='two'"):
        tuning.current("gloo")
    with pytest.raises(ValueError, match="unknown tuning field"):
        with tuning.override(lane=2):
            pass
    with pytest.raises(ValueError, match="lanes"):
        with tuning.override(lanes=0):
            pass


def test_chunks_must_be_a_positive_integer():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunks"):
            ring_all_reduce(torch.ones(3), chunks=bad)


def test_tune_command_and_session_summary_on_gloo(tmp_path, capsys):
    argv = ["--world", "2", "--backend", "gloo", "--sizes", "65536", "--iters", "2", "--out", str(tmp_path)]
    assert commands.tune(argv) == 0
    result = json.loads((tmp_path / "tune.json").read_text())
    assert {r["lanes"] for r in result["steps"]} == {1, 2}
    assert {(r["collective"], r["lanes"]) for r in result["configs"]} == {
        (c, lanes) for c in ("all_reduce", "all_gather", "reduce_scatter") for lanes in (1, 2)}
    assert all(r["ok"] and r["time_s"] > 0 and r["host_s"] > 0 for r in result["configs"])
    assert {r.get("check") for r in result["check"]} == {True, False, None}  # None: the built-in
    assert "header check" in capsys.readouterr().out
    bench = ["--world", "2", "--backend", "gloo", "--max-bytes", "4096", "--factor", "8", "--iters", "2",
             "--no-overlap", "--out", str(tmp_path)]
    assert commands.bench(bench) == 0
    log = tmp_path / "pytest.log"
    log.write_text("....\n12 passed, 3 skipped in 80.1s\npytest exit code 0\n")
    text = load("collectives_summary").summarize(tmp_path, log)
    assert "12 passed, 3 skipped" in text and "(pytest exit code 0)" in text
    for needle in ("all_reduce", "all_gather", "reduce_scatter", "target >= 0.85x", "alpha-beta",
                   "overlap: not measured", "one ring step", "header check"):
        assert needle in text, needle
