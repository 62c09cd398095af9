"""The runner's block-table mirror: a step's rows stay equal to the sequences' lists through
appends, replaced lists (copy-on-write: same length, one id changed), rows out of order."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from layer4_algorithms.block_table_mirror import BlockTableMirror


def padded(tables: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def check(mirror: BlockTableMirror, seqs) -> None:
    where, lens = mirror.sync_rows(seqs)
    assert lens == [len(q.block_table) for q in seqs]
    want = padded([q.block_table for q in seqs])
    assert np.array_equal(mirror.table[where, :want.shape[1]], want)
    table, lens_np = mirror.gather(seqs)
    assert np.array_equal(table, want) and lens_np.tolist() == lens


def test_rows_follow_appends_replaced_lists_and_reordering():
    mirror = BlockTableMirror(4, 6)
    seqs = [SimpleNamespace(row=r, block_table=[10 * r + 1]) for r in range(3)]
    check(mirror, seqs)
    assert isinstance(mirror.sync_rows(seqs)[0], slice)  # rows 0, 1, 2: a view
    seqs[1].block_table.append(12)  # a block added in place
    check(mirror, seqs)
    seqs[0].block_table = [99]  # copy-on-write: a new list of the same length
    check(mirror, seqs)
    seqs[2].block_table.extend([22, 23])
    check(mirror, seqs)
    seqs[2].block_table = [7]  # shorter than the row held: its tail is cleared
    check(mirror, seqs)
    order = [seqs[2], seqs[0]]  # rows 2, 0: gathered
    assert not isinstance(mirror.sync_rows(order)[0], slice)
    check(mirror, order)
    seqs[2].block_table.append(5)
    check(mirror, order)


def test_a_sequence_the_mirror_cannot_hold_is_refused():
    mirror = BlockTableMirror(2, 3)
    assert mirror.sync_rows([SimpleNamespace(row=None, block_table=[1])]) is None
    assert mirror.sync_rows([SimpleNamespace(row=2, block_table=[1])]) is None
    assert mirror.sync_rows([SimpleNamespace(row=0, block_table=[1, 2, 3, 4])]) is None
    assert mirror.gather([SimpleNamespace(row=1, block_table=[1, 2, 3, 4])]) is None


def test_unchanged_rows_of_the_last_sync_are_answered_without_a_pass():
    """sync_rows(seqs, unchanged=True): the caller vouches no table changed. For the last
    synced sequences, in order, the last answer comes back as it is (even if a list was
    changed behind the mirror's back: the caller's promise is what is trusted); for any other
    list of sequences it syncs as usual."""
    mirror = BlockTableMirror(4, 6)
    seqs = [SimpleNamespace(row=r, block_table=[10 * r + 1]) for r in range(3)]
    first = mirror.sync_rows(seqs)
    assert mirror.sync_rows(list(seqs), unchanged=True) is first  # the same answer object
    seqs[1].block_table.append(12)  # a real change: without the promise it is synced
    check(mirror, seqs)
    assert mirror.sync_rows(list(seqs), unchanged=True)[1] == [1, 2, 1]
    seqs[0].block_table.append(3)  # broken promise: not seen (what the flag means)
    assert mirror.sync_rows(list(seqs), unchanged=True)[1] == [1, 2, 1]
    order = [seqs[2], seqs[0]]  # other sequences: synced in full, promise or not
    where, lens = mirror.sync_rows(order, unchanged=True)
    assert lens == [1, 2] and np.array_equal(mirror.table[where, :2], padded([[21], [1, 3]]))


def test_row_of_is_gather_of_one_and_leaves_the_row_to_a_later_sync():
    mirror = BlockTableMirror(2, 40)
    old = SimpleNamespace(row=0, block_table=[5, 6, 7])
    check(mirror, [old])
    new = SimpleNamespace(row=0, block_table=list(range(100, 135)))  # row 0 again, 35 blocks
    table, lens = mirror.row_of(new)
    assert table.tolist() == [new.block_table] and lens.tolist() == [35]
    assert mirror.table[0, :3].tolist() == [5, 6, 7]  # not synced
    new.block_table.append(200)  # grown in place since: the first sync writes the whole row
    check(mirror, [new])
    assert mirror.row_of(SimpleNamespace(row=None, block_table=[1])) is None
    assert mirror.row_of(SimpleNamespace(row=1, block_table=list(range(41)))) is None  # too wide
