"""DDP: bucketed, overlapped all-reduce gives the single-process full-batch gradients.

One launch per world size (2 and 3) runs every case on every rank: torch's async all-reduce
and layer 2's ring on a thread, equal shards averaged and uneven shards summed, bucket
sizes that split the model's unevenly sized parameters into several buckets.
"""
from __future__ import annotations

import time

import pytest
import torch

import layer5_parallel as L5
from layer5_parallel import train_adapter as A
from layer5_parallel.data_parallel import ddp

# layer 2's launch: ranks forked from one server (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("fork_server_module")

# (communication, bucket bytes, average): averaged equal slices, summed uneven ones
CASES = [("torch", 3000, True), ("ours", 7000, True), ("torch", 1 << 30, True),
         ("ours", 5000, False)]


def _rank_cases() -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank: the ranks share a small machine
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for k, (comm, bucket_bytes, average) in enumerate(CASES):
        config = A.tiny_config(layers=3, hidden=32, heads=4, kv_heads=2, vocab=50, ffn=44)
        rows = 2 * world if average else 2 * world + 1  # summed mode: uneven shards
        ids, targets = A.random_batch(config, batch=rows, seq_len=7, seed=k)
        ref = A.build_model(config, seed=3)
        A.full_loss(ref, ids, targets).backward()
        model = A.build_model(config, seed=3 + rank)  # DDP must broadcast rank 0's weights
        ddp = L5.DistributedDataParallel(model, bucket_bytes=bucket_bytes, comm=comm,
                                         average=average)
        mine = ids.tensor_split(world)[rank], targets.tensor_split(world)[rank]
        total = None if average else ids.numel()
        t0 = time.perf_counter()
        A.full_loss(model, *mine, total).backward()
        backward_end = time.perf_counter()
        ddp.finish_gradients()
        ref_grads = dict(ref.named_parameters())
        err = max((p.grad - ref_grads[n].grad).abs().max().item()
                  for n, p in model.named_parameters())
        out.append(dict(case=(comm, bucket_bytes, average), err=err, buckets=len(ddp.buckets),
                        launched_in_backward=all(t0 <= s <= backward_end
                                                 for s, _ in ddp.last_intervals),
                        overlap=L5.overlap_fraction(ddp.last_intervals, backward_end)))
        ddp.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_gradients_equal_single_process(world):
    results = L5.engine.executor.comm.launch(_rank_cases, world, backend="gloo", timeout_s=240)
    for rank, cases in enumerate(results):
        for case in cases:
            assert case["err"] < 1e-6, (world, rank, case)
            assert case["launched_in_backward"], case  # hooks, not a loop after backward
            assert 0.0 <= case["overlap"] <= 1.0
        by = {c["case"]: c for c in cases}
        assert by[CASES[0]]["buckets"] > 3 and by[CASES[2]]["buckets"] == 1


def test_buckets_follow_backward_order_and_size():
    model = A.build_model(A.tiny_config(layers=2, hidden=32, heads=4, kv_heads=2, vocab=50, ffn=44))
    params = [p for p in model.parameters()][::-1]
    buckets = ddp._make_buckets(params, 4000)
    flat = [p for b in buckets for p in b.params]
    assert [id(p) for p in flat] == [id(p) for p in params]  # reverse registration order
    for b in buckets:
        nbytes = sum(p.numel() * 4 for p in b.params)
        assert nbytes <= 4000 or len(b.params) == 1 or nbytes - b.params[-1].numel() * 4 < 4000


def test_overlap_fraction_and_replicas():
    assert L5.overlap_fraction([(0.0, 1.0), (0.5, 2.0)], 1.0) == pytest.approx(0.5)
    assert L5.overlap_fraction([(0.0, 1.0), (3.0, 4.0)], 10.0) == 1.0
    items = list(range(7))
    shares = [L5.replica_share(items, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == items and [len(s) for s in shares] == [3, 2, 2]
    with pytest.raises(ValueError, match="rank"):
        L5.replica_share(items, 3, 3)


def test_bad_arguments():
    model = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="bucket_bytes"):
        L5.DistributedDataParallel(model, bucket_bytes=0)
