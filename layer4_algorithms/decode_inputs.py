"""A decode step's inputs in one pass over its sequences (the model runner's fast path).

Most steps of a busy engine are decode steps: every scheduled sequence brings one token,
no drafts. Their inputs are per sequence: the input token (on the host, or still on the
device: the previous step's sample, `ScheduledSeq.pending`), the position (= context_len),
the block table (the runner's BlockTableMirror row, synced with the sequence's list) and
whether the step reaches the sequence's end (it samples: always, but for a prompt's
one-token chunk that stops short of its end). The general path gathers these in
several passes over the sequences (the input ids, the query and context lengths, the
tables, the sampling rows), each a Python loop paid per sequence per step; this builds all of
them in one loop, and its table gather is the same numpy gather from the mirror.

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
    tokens themselves, no gather)."""

    ids: list[int]
    src: list[int]
    dst: list[int]
    context_lens: np.ndarray
    table: np.ndarray
    lens: np.ndarray
    rows: list[int | None]
    in_order: bool = False


def decode_inputs(mirror, group: Sequence) -> DecodeInputs | None:
    """The inputs of a step of one-token ScheduledSeqs `group` (None: not such a step, or a
    sequence the mirror cannot hold). Syncs the mirror's rows as BlockTableMirror.gather."""
    if not group:
        return None
    sync = mirror.sync
    ids: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    rows: list[int] = []
    lens: list[int] = []
    ctx: list[int] = []
    longest = 0
    samples: list[int | None] = []  # the logits row of each (one per sequence), if it samples
    in_order = True
    j = 0
    for s in group:
        if s.num_new_tokens != 1 or s.spec_token_ids:
            return None
        seq = s.seq
        n = sync(seq)
        if n < 0:
            return None
        rows.append(seq.row)
        lens.append(n)
        if n > longest:
            longest = n
        c = s.context_len
        ctx.append(c)
        p = s.pending
        if p >= 0:  # the previous step's sample, still on the device
            dst.append(j)
            src.append(p)
            ids.append(0)
            in_order = in_order and p == j
        else:
            in_order = False
            ids.append(seq.token_ids[c])
        if c + 1 == len(seq.token_ids) + seq.num_pending:  # it samples
            samples.append(j)
        else:
            samples.append(None)
        j += 1
    gathered, lens_np = mirror.take(rows, lens, longest)
    return DecodeInputs(ids, src, dst, np.array(ctx, dtype=np.int64), gathered, lens_np, samples,
                        in_order)
