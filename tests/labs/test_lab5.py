"""Lab 5 grader: Megatron's f/g with column- and row-parallel linears (forward and backward) on
gloo ranks, and ring attention's step (one block's partial attention + the log-sum-exp merge).

Graded through the `impl` fixture (tests/labs/conftest.py): layer5_parallel under plain
pytest (its megatron_fg.py and ring_attention.py), a student's exercises.py under
`stack grade --lab 5`. Seeds are drawn afresh every run and printed in every failure message.

* Exercise 1 runs on 2 gloo ranks of this CPU (`launch`: one launch runs every check). Each
  rank loads the graded code itself (the layer by name, or the submission from its path,
  behind the same import guard as here), runs each check on weights it draws from the shared
  seed (odd sizes, so shards are uneven), compares with one process computing the whole
  layer — output, the input's gradient, every shard's weight and bias gradients — and
  reports one verdict per check. Each check has its own time budget (CHECK_LIMIT_S, its
  barrier included): a check that hangs or kills a rank fails alone, and the checks after it
  run in a fresh launch. Starting ranks on a loaded machine can take half a minute, so the
  tests that start them have a pytest timeout above stack grade's default.
* Exercise 2 is pure math, graded in this process: attention_block against a plain softmax
  (causal, non-causal, GQA, rows that see no key), merge_partial against attention over the
  union of two blocks, and a whole simulated ring (load-balanced chunks, blocks arriving in ring
  order) against torch's scaled_dot_product_attention.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import random
import threading
import traceback
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from .submission_guard import load_submission

REFERENCE = "layer5_parallel"

WORLD = 2  # two ranks: shards still uneven (sizes are odd), and half the start-up of three
LAUNCH_TIMEOUT_S = 60.0  # for the ranks to start (idle ~5 s; a loaded machine is slow) ...
#: ... plus this per check: each check's own budget (idle: < 1 s; the environment variable
#: sets it, as test_planted does to keep a planted hang short)
CHECK_LIMIT_S = float(os.environ.get("LLM_STACK_LAB5_CHECK_LIMIT_S", "30"))
RANK_TEST_TIMEOUT_S = 300  # pytest-timeout for the tests that start the ranks (the fixture runs
# in the first one), above stack grade's 30 s default: the launches have their own limits below
seeds = random.SystemRandom()  # fresh inputs every run: an answer must be right for any input


# ================================================================ exercise 1, inside each rank
def _load(source: str) -> ModuleType:
    if source.endswith(".py"):  # a submission: behind the import guard, as in the parent
        return load_submission(source)
    return importlib.import_module(source)


def _shard(n: int, world: int, rank: int) -> slice:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _close(name: str, got: torch.Tensor | None, want: torch.Tensor) -> None:
    if got is None:
        raise AssertionError(f"{name}: no gradient reached it (is the autograd graph connected?)")
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{name}: wrong values (max abs error {err:.3g})")


def _check_f(ex: ModuleType, g: torch.Generator, me: int) -> None:
    x = torch.randn(4, 7, generator=g).requires_grad_()
    y = ex.copy_to_tp_region(x)
    _close("f forward (must be the identity)", y.detach(), x.detach())
    grads = torch.randn(WORLD, 4, 7, generator=g)  # rank r back-propagates grads[r]
    y.backward(grads[me])
    _close("f backward (must sum every rank's gradient)", x.grad, grads.sum(0))


def _check_g(ex: ModuleType, g: torch.Generator, me: int) -> None:
    xs = torch.randn(WORLD, 5, 3, generator=g)
    x = xs[me].clone().requires_grad_()
    before = x.detach().clone()
    y = ex.reduce_from_tp_region(x)
    _close("g forward (must sum x over the ranks)", y.detach(), xs.sum(0))
    _close("g must not modify its input", x.detach(), before)
    grad = torch.randn(5, 3, generator=g)  # the loss is the same on every rank after g
    y.backward(grad)
    _close("g backward (must pass the gradient unchanged)", x.grad, grad)


def _linear_case(g: torch.Generator, d_in: int, d_out: int) -> tuple[dict, dict, torch.Tensor]:
    """Random x (2, 5, d_in), w (d_out, d_in), b (d_out,) and dy (2, 5, d_out); the dense
    layer's output y on them, and in `full` leaf copies of x, w, b holding the gradients of
    the loss sum(y * dy): what each rank's shard is checked against."""
    c = dict(x=torch.randn(2, 5, d_in, generator=g), w=torch.randn(d_out, d_in, generator=g),
             b=torch.randn(d_out, generator=g), dy=torch.randn(2, 5, d_out, generator=g))
    full = {k: c[k].clone().requires_grad_() for k in ("x", "w", "b")}
    want = F.linear(full["x"], full["w"], full["b"])
    (want * c["dy"]).sum().backward()
    return c, full, want.detach()


def _check_column(ex: ModuleType, g: torch.Generator, me: int) -> None:
    c, full, want = _linear_case(g, 6, 11)
    rows = _shard(11, WORLD, me)
    x = c["x"].clone().requires_grad_()
    w, b = c["w"][rows].clone().requires_grad_(), c["b"][rows].clone().requires_grad_()
    got = ex.column_parallel_linear(x, w, b)
    _close("column-parallel output", got.detach(), want[..., rows])
    (got * c["dy"][..., rows]).sum().backward()  # the loss: the sum of the ranks' parts
    _close("column-parallel dL/dx (whole, on every rank)", x.grad, full["x"].grad)
    _close("column-parallel dL/dW (this rank's rows)", w.grad, full["w"].grad[rows])
    _close("column-parallel dL/db (this rank's slice)", b.grad, full["b"].grad[rows])
    none = ex.column_parallel_linear(c["x"], c["w"][rows])
    _close("column-parallel without bias", none.detach(), (c["x"] @ c["w"][rows].T))


def _check_row(ex: ModuleType, g: torch.Generator, me: int) -> None:
    c, full, want = _linear_case(g, 10, 4)
    cols = _shard(10, WORLD, me)
    x = c["x"][..., cols].clone().requires_grad_()
    w, b = c["w"][:, cols].clone().requires_grad_(), c["b"].clone().requires_grad_()
    got = ex.row_parallel_linear(x, w, b)
    _close("row-parallel output (bias added once)", got.detach(), want)
    (got * c["dy"]).sum().backward()  # every rank holds the same loss after g
    _close("row-parallel dL/dx (this rank's slice)", x.grad, full["x"].grad[..., cols])
    _close("row-parallel dL/dW (this rank's columns)", w.grad, full["w"].grad[:, cols])
    _close("row-parallel dL/db", b.grad, full["b"].grad)


def _check_mlp(ex: ModuleType, g: torch.Generator, me: int) -> None:
    d, hidden = 5, 13
    x0, dy = torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
    w1, b1 = torch.randn(hidden, d, generator=g), torch.randn(hidden, generator=g)
    w2, b2 = torch.randn(d, hidden, generator=g), torch.randn(d, generator=g)
    full = [t.clone().requires_grad_() for t in (x0, w1, b1, w2, b2)]
    want = F.linear(F.gelu(F.linear(full[0], full[1], full[2])), full[3], full[4])
    (want * dy).sum().backward()
    s = _shard(hidden, WORLD, me)
    mine = [t.clone().requires_grad_() for t in (x0, w1[s], b1[s], w2[:, s], b2)]
    h = F.gelu(ex.column_parallel_linear(mine[0], mine[1], mine[2]))
    got = ex.row_parallel_linear(h, mine[3], mine[4])
    _close("MLP output", got.detach(), want.detach())
    (got * dy).sum().backward()
    _close("MLP dL/dx", mine[0].grad, full[0].grad)
    _close("MLP dL/dW1 (rows)", mine[1].grad, full[1].grad[s])
    _close("MLP dL/dW2 (columns)", mine[3].grad, full[3].grad[:, s])


CHECKS = {"f": _check_f, "g": _check_g, "column": _check_column, "row": _check_row,
          "mlp": _check_mlp}


def _note(log: Path, event: dict) -> None:
    with log.open("a") as f:  # one line per event: a rank that dies leaves what it did
        f.write(json.dumps(event) + "\n")


def _out_of_time(log: Path, name: str) -> None:
    _note(log, {"out_of_time": name})
    os._exit(3)  # a rank stuck in a collective cannot be interrupted: leave, the parent sees it


def rank_checks(source: str, seed: int, names: list[str], progress: str) -> dict[str, str | None]:
    """On every rank: run the named checks, each within CHECK_LIMIT_S (its barrier too); None
    if one passed, else why it failed. Each start and verdict goes to progress/rank<r>.jsonl,
    so the parent knows which check a rank that hung or died was in."""
    import torch.distributed as dist

    me = dist.get_rank()
    log = Path(progress) / f"rank{me}.jsonl"
    ex = _load(source)
    verdicts: dict[str, str | None] = {}
    for name in names:
        g = torch.Generator().manual_seed(seed + list(CHECKS).index(name))  # same on every rank
        _note(log, {"start": name})
        watchdog = threading.Timer(CHECK_LIMIT_S, _out_of_time, (log, name))
        watchdog.daemon = True
        watchdog.start()
        try:
            CHECKS[name](ex, g, me)
            verdicts[name] = None
        except Exception as exc:
            tb = traceback.format_exc(limit=-3)
            verdicts[name] = f"rank {me}: {type(exc).__name__}: {exc}\n{tb}"
        dist.barrier()  # keep the ranks in step: a rank that failed early must not run ahead
        watchdog.cancel()
        _note(log, {"done": name, "verdict": verdicts[name]})
    return verdicts


def _finished(progress: Path, names: list[str]) -> tuple[dict[str, str | None], str | None]:
    """From the ranks' progress logs: the verdicts of the checks every rank finished, and the
    check they stopped in (None if no rank began one)."""
    done: dict[str, list[str | None]] = {}
    started: set[str] = set()
    for log in progress.glob("rank*.jsonl"):
        for event in map(json.loads, log.read_text().splitlines()):
            started.update([event["start"]] if "start" in event else [])
            if "done" in event:
                done.setdefault(event["done"], []).append(event["verdict"])
    finished = {n: next((v for v in vs if v), None) for n, vs in done.items()
                if len(vs) == WORLD}
    stopped = next((n for n in names if n in started and n not in finished), None)
    return finished, stopped


@pytest.fixture(scope="module")
def verdicts(impl: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every exercise-1 check's verdict (None: passed). One launch runs them all; a check
    that hangs or kills a rank costs that check only: the ranks leave after CHECK_LIMIT_S,
    and a fresh launch runs the checks after it."""
    from layer2_comm import launch  # the course's own launcher (local gloo ranks)

    seed = seeds.randrange(2**31)
    source = impl.__name__ if impl.__name__ == REFERENCE else impl.__file__
    found: dict[str, str | None] = {}
    left = list(CHECKS)
    while left:
        progress = tmp_path_factory.mktemp("lab5-ranks")
        try:
            reports = launch(rank_checks, WORLD, source, seed, left, str(progress),
                             backend="gloo", timeout_s=LAUNCH_TIMEOUT_S + CHECK_LIMIT_S * len(left))
            found.update((n, next((r[n] for r in reports if r[n]), None)) for n in left)
            break
        except RuntimeError as exc:  # a rank hung, died or never started
            finished, stopped = _finished(progress, left)
            found.update(finished)
            why = str(exc)[-1500:]
            if stopped is None:  # no check began: the ranks did not start
                found.update((n, f"the ranks did not start (seed {seed}): {why}")
                             for n in left if n not in found)
                break
            found[stopped] = (f"seed {seed}: did not finish within its {CHECK_LIMIT_S:g} s on "
                              f"every rank (a hang, a deadlock or a crash in this check; the "
                              f"checks after it ran in a fresh launch): {why}")
            left = [n for n in left if n not in found]
    return {"seed": seed, "verdicts": found}


def _verdict(verdicts: dict, name: str) -> None:
    failure = verdicts["verdicts"][name]
    if failure:
        pytest.fail(failure if failure.startswith(("seed", "the ranks")) else
                    f"seed {verdicts['seed']}: {failure}", pytrace=False)


#: exercise 1's checks, as graded: (check, points, test id)
EXERCISE_1 = [("f", 10, "f_copy_to_tp_region"), ("g", 10, "g_reduce_from_tp_region"),
              ("column", 15, "column_parallel_linear"), ("row", 15, "row_parallel_linear"),
              ("mlp", 10, "column_then_row_mlp")]


@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
@pytest.mark.parametrize("check", [pytest.param(check, marks=pytest.mark.points(points), id=name)
                                   for check, points, name in EXERCISE_1])
def test_tensor_parallel(verdicts, check):
    _verdict(verdicts, check)


# ================================================================ exercise 2, in this process
def _softmax_attention(q, k, v, q_pos, k_pos, causal=True):
    """Plain softmax attention with GQA, and the log-sum-exp, in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(k_pos.view(1, -1) > q_pos.view(-1, 1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.nan_to_num(torch.softmax(s, -1)) @ v
    return out.float(), lse.float()


#: Query/key scales the block and merge checks run at: unit scores, and scores in the
#: hundreds (large activations give those), where exp(s) overflows float32 (above ~88): only
#: a softmax and log-sum-exp that subtract the max survive them.
SCALES = (1.0, 12.0)


def _qkv(g, B=2, H=4, Hkv=4, n=7, m=9, D=8, scale=1.0):
    return (scale * torch.randn(B, H, n, D, generator=g),
            scale * torch.randn(B, Hkv, m, D, generator=g), torch.randn(B, Hkv, m, D, generator=g))


def _gen() -> tuple[torch.Generator, int]:
    seed = seeds.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _block_check(impl, g, seed, causal, **shape):
    for scale in SCALES:
        q, k, v = _qkv(g, **shape, scale=scale)
        q_pos = torch.randperm(40, generator=g)[: q.shape[2]]
        k_pos = torch.randperm(40, generator=g)[: k.shape[2]]
        q_pos[0] = -1  # this query sees no key at all under the causal mask
        out, lse = impl.attention_block(q, k, v, q_pos, k_pos, causal=causal)
        want_out, want_lse = _softmax_attention(q, k, v, q_pos, k_pos, causal)
        where = f"(seed {seed}, causal={causal}, shapes {shape or 'default'}, scores ~{scale**2:g})"
        assert not out.isnan().any() and not lse.isnan().any(), f"NaN in the result {where}"
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5, msg=f"lse {where}")
        torch.testing.assert_close(out.float(), want_out, rtol=1e-4, atol=1e-4,
                                   msg=f"out {where}")


@pytest.mark.points(8)
def test_attention_block_without_mask(impl):
    g, seed = _gen()
    _block_check(impl, g, seed, causal=False)


@pytest.mark.points(8)
def test_attention_block_causal_and_empty_rows(impl):
    g, seed = _gen()
    _block_check(impl, g, seed, causal=True, n=11, m=6)


@pytest.mark.points(4)
def test_attention_block_gqa(impl):
    g, seed = _gen()
    _block_check(impl, g, seed, causal=True, H=6, Hkv=2, n=5, m=13)


@pytest.mark.points(10)
def test_merge_partial(impl):
    g, seed = _gen()
    for scale in SCALES:
        q, k, v = _qkv(g, m=12, scale=scale)
        q_pos, k_pos = torch.arange(5, 12), torch.randperm(12, generator=g)
        a, b = k_pos[:5], k_pos[5:]
        oa, la = _softmax_attention(q, k[:, :, :5], v[:, :, :5], q_pos, a)
        ob, lb = _softmax_attention(q, k[:, :, 5:], v[:, :, 5:], q_pos, b)
        out, lse = impl.merge_partial(oa, la, ob, lb)
        want_out, want_lse = _softmax_attention(q, k, v, q_pos, k_pos)
        where = f"(seed {seed}, scores ~{scale**2:g})"
        torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5, msg=f"lse {where}")
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4, msg=f"out {where}")
    empty_out, empty_lse = torch.zeros_like(oa), torch.full_like(la, float("-inf"))
    out, lse = impl.merge_partial(empty_out, empty_lse, oa, la)  # nothing yet + a block
    torch.testing.assert_close(out, oa, msg="merging into an empty result must give the block")
    out, lse = impl.merge_partial(empty_out, empty_lse, empty_out, empty_lse)
    assert not out.isnan().any(), "two empty results must merge to 0, not NaN"
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.points(10)
def test_simulated_ring_equals_full_causal_attention(impl):
    g, seed = _gen()
    world, S = 3, 29
    q, k, v = _qkv(g, B=1, H=4, Hkv=2, n=S, m=S)
    bounds = [_shard(S, 2 * world, c) for c in range(2 * world)]
    held = [torch.cat([torch.arange(S)[bounds[r]], torch.arange(S)[bounds[2 * world - 1 - r]]])
            for r in range(world)]  # rank r: chunks r and 2N-1-r
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for r in range(world):
        qr = q[:, :, held[r]]
        out = torch.zeros(*qr.shape[:-1], v.shape[-1])
        lse = torch.full(qr.shape[:-1], float("-inf"))
        for step in range(world):  # the K/V block in hand comes from rank r - step
            kp = held[(r - step) % world]
            o, lb = impl.attention_block(qr, k[:, :, kp], v[:, :, kp], held[r], kp)
            out, lse = impl.merge_partial(out, lse, o, lb)
        torch.testing.assert_close(out.float(), want[:, :, held[r]], rtol=1e-4, atol=1e-5,
                                   msg=f"rank {r}'s rows after the ring (seed {seed})")
