"""A decode step's inputs in one pass over its sequences (the model runner's fast path).

Most steps of a busy engine are decode steps: every scheduled sequence brings one token,
no drafts. Their inputs are per sequence: the input token (on the host, or still on the
device: the previous step's sample, `ScheduledSeq.pending`), the position (= context_len),
the block table (the runner's BlockTableMirror row, synced with the sequence's list) and
whether the step reaches the sequence's end (it samples: always, but for a prompt's
one-token chunk that stops short of its end). Each is read for all sequences at once (a list
comprehension or a map a field: a few microseconds at 256 sequences, where a Python loop
doing all of them costs ~0.5 us a sequence), and the usual cases are recognised whole: every
input token on the device in the last step's order (steady decoding under async scheduling:
nothing to gather), or every one on the host (synchronous steps, pipeline lanes); every
sequence sampling. The table is gathered from the mirror only when a caller asks for it.
A step the scheduler made of plain decodes only (`SchedulerOutput.plain_decodes`: one token
each, the sequence's last, no block added or copied) is taken as such: no check of its
shape, every sequence samples, and when its sequences are the last synced ones, in order,
the mirror's rows are as they were (no pass over the tables at all).

`decode_inputs` returns None for a step that is not all one-token steps, or that has a
sequence without a mirror row (the caller then takes the general path).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class DecodeInputs:
    """ids / src / dst: host input ids, with ids[dst[i]] taken from the previous step's
    tokens on the device, row src[i] (ModelRunner.place_ids); context_lens (B,); table (B,
    longest) zero-padded block ids and lens (B,) their counts; rows: each sequence's logits
    row (None: it does not sample); in_order: every input token is on the device, sequence
    j's at row j of the previous step's tokens (steady decoding: the input ids are those
    tokens themselves, no gather). table may view the mirror: read it before the next step."""

    ids: list[int]
    src: list[int]
    dst: list[int]
    context_lens: np.ndarray
    table: np.ndarray
    lens: np.ndarray
    rows: list[int | None]
    in_order: bool = False


def decode_inputs(mirror, group: Sequence, plain: bool = False) -> DecodeInputs | None:
    """The inputs of a step of one-token ScheduledSeqs `group` (None: not such a step, or a
    sequence the mirror cannot hold). Syncs the mirror's rows as BlockTableMirror.gather.
    plain: every one of group is a plain decode (SchedulerOutput.plain_decodes == len(group))."""
    if not group or (not plain and any([s.num_new_tokens != 1 or s.spec_token_ids
                                        for s in group])):
        return None
    seqs = [s.seq for s in group]
    got = mirror.sync_rows(seqs, unchanged=plain)
    if got is None:
        return None
    where, lens = got
    B = len(group)
    ctx = [s.context_len for s in group]
    pending = [s.pending for s in group]
    order = list(range(B))
    in_order = pending == order  # steady decoding: sequence j's token is row j of the last step's
    if in_order or min(pending) >= 0:  # every input token on the device
        ids, src, dst = [0] * B, pending, order
    elif max(pending) < 0:  # every input token on the host
        ids, src, dst = [q.token_ids[c] for q, c in zip(seqs, ctx, strict=True)], [], []
    else:
        ids = [0 if p >= 0 else q.token_ids[c] for q, c, p in zip(seqs, ctx, pending, strict=True)]
        dst = [j for j, p in enumerate(pending) if p >= 0]
        src = [pending[j] for j in dst]
    # a sequence samples when the step reaches its end (tokens on the device count), which
    # only a prompt's one-token chunk short of its end does not
    ends = ctx if plain else [len(q.token_ids) + q.num_pending - 1 for q in seqs]
    samples = list(range(B)) if ends == ctx else [
        j if e == c else None for j, (e, c) in enumerate(zip(ends, ctx, strict=True))]
    table = mirror.table[where, :max(lens)]  # (a view of the mirror when its rows are in order)
    return DecodeInputs(ids, src, dst, np.array(ctx, dtype=np.int64), table,
                        np.array(lens, dtype=np.int64), samples, in_order)
