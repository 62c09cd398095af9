"""The vocab-parallel embedding of a tensor-parallel shard: each rank looks up only its rows
(the others' ids read its zero row) and the all-reduce puts every row together, so the sum
over the ranks is the whole embedding, at a vocabulary the ranks split unevenly; a tied LM
head shares the embedding's rows (not its zero row)."""
from __future__ import annotations

import pytest
import torch

from layer5_parallel.tensor_parallel.shard import VocabParallelEmbedding, VocabParallelLMHead


class _Identity:
    """A comm whose collectives leave each rank's part as it is (summed by the test)."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x):
        return x.unsqueeze(0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_sum_over_ranks_is_the_whole_embedding(world):
    V, H = 97, 5
    g = torch.Generator().manual_seed(world)
    full = torch.randn(V, H, generator=g)
    per = -(-V // world)
    ids = torch.tensor([0, 1, per - 1, min(per, V - 1), V - 1, 50, 50, 96, 2 * per % V])
    total = torch.zeros(len(ids), H)
    for rank in range(world):
        v0, v1 = min(rank * per, V), min((rank + 1) * per, V)
        table = torch.zeros(per + 1, H)
        table[: v1 - v0] = full[v0:v1]
        emb = VocabParallelEmbedding(table, v0, v1, _Identity(), V)
        part = emb(ids)
        mine = (ids >= v0) & (ids < v1)
        assert torch.equal(part[~mine], torch.zeros_like(part[~mine]))  # others' ids: zeros
        total += part
        head = VocabParallelLMHead(emb.weight, V, _Identity())
        assert head.weight is emb.weight and head.weight.shape == (per, H)
        assert head.weight.data_ptr() == emb.table.data_ptr()  # the same rows, no copy
    assert torch.equal(total, full[ids])


def test_a_table_without_its_zero_row_is_refused():
    table = torch.ones(4, 3)
    with pytest.raises(ValueError, match="zero"):
        VocabParallelEmbedding(table, 0, 4, _Identity(), 8)
