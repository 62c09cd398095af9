"""Lab 5 grader: Megatron's f/g with column- and row-parallel linears (forward and backward) on
gloo ranks, and ring attention's step (one block's partial attention + the log-sum-exp merge).

Graded through the `impl` fixture (tests/labs/conftest.py): layer5_parallel under plain
pytest (its megatron_fg.py and ring_attention.py), a student's exercises.py under
`stack grade --lab 5`. Seeds are drawn afresh every run and printed in every failure message.

* Exercise 1 runs on 2 gloo ranks of this CPU (`launch`, one launch for the module, limited to
  LAUNCH_TIMEOUT_S, with a pytest timeout above it for those tests, since starting ranks on a
  loaded machine can take half a minute: a submission that hangs fails exercise 1's tests,
  never the run). Each rank
  loads the graded code itself (by name, or from the submission's path), runs every check on
  weights it draws from the shared seed (odd sizes, so shards are uneven), compares
  with one process computing the whole layer — output, the input's gradient, every shard's
  weight and bias gradients — and reports one verdict per check. Each test scores its check.
* Exercise 2 is pure math, graded in this process: attention_block against a plain softmax
  (causal, non-causal, GQA, rows that see no key), merge_partial against attention over the
  union of two blocks, and a whole simulated ring (load-balanced chunks, blocks arriving in ring
  order) against torch's scaled_dot_product_attention.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import random
import traceback
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

REFERENCE = "layer5_parallel"

WORLD = 2  # two ranks: shards still uneven (sizes are odd), and half the start-up of three
LAUNCH_TIMEOUT_S = 80.0  # idle, the ranks start and finish in ~5 s; a loaded machine is slow
RANK_TEST_TIMEOUT_S = 90  # pytest-timeout for the tests that start the ranks (the fixture runs
# in the first one), above stack grade's 30 s default: the launch has its own limit just below
seeds = random.SystemRandom()  # fresh inputs every run: an answer must be right for any input


# ================================================================ exercise 1, inside each rank
def _load(source: str) -> ModuleType:
    if source.endswith(".py"):  # a submission: a fresh process cannot import it by name
        spec = importlib.util.spec_from_file_location(f"submission_{Path(source).stem}", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
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


def _linear_case(g: torch.Generator, d_in: int, d_out: int) -> dict[str, torch.Tensor]:
    return dict(x=torch.randn(2, 5, d_in, generator=g), w=torch.randn(d_out, d_in, generator=g),
                b=torch.randn(d_out, generator=g), dy=torch.randn(2, 5, d_out, generator=g))


def _check_column(ex: ModuleType, g: torch.Generator, me: int) -> None:
    c = _linear_case(g, 6, 11)
    rows = _shard(11, WORLD, me)
    full = {k: c[k].clone().requires_grad_() for k in ("x", "w", "b")}
    want = F.linear(full["x"], full["w"], full["b"])
    (want * c["dy"]).sum().backward()
    x = c["x"].clone().requires_grad_()
    w, b = c["w"][rows].clone().requires_grad_(), c["b"][rows].clone().requires_grad_()
    got = ex.column_parallel_linear(x, w, b)
    _close("column-parallel output", got.detach(), want.detach()[..., rows])
    (got * c["dy"][..., rows]).sum().backward()  # the loss: the sum of the ranks' parts
    _close("column-parallel dL/dx (whole, on every rank)", x.grad, full["x"].grad)
    _close("column-parallel dL/dW (this rank's rows)", w.grad, full["w"].grad[rows])
    _close("column-parallel dL/db (this rank's slice)", b.grad, full["b"].grad[rows])
    none = ex.column_parallel_linear(c["x"], c["w"][rows])
    _close("column-parallel without bias", none.detach(), (c["x"] @ c["w"][rows].T))


def _check_row(ex: ModuleType, g: torch.Generator, me: int) -> None:
    c = _linear_case(g, 10, 4)
    cols = _shard(10, WORLD, me)
    full = {k: c[k].clone().requires_grad_() for k in ("x", "w", "b")}
    want = F.linear(full["x"], full["w"], full["b"])
    (want * c["dy"]).sum().backward()
    x = c["x"][..., cols].clone().requires_grad_()
    w, b = c["w"][:, cols].clone().requires_grad_(), c["b"].clone().requires_grad_()
    got = ex.row_parallel_linear(x, w, b)
    _close("row-parallel output (bias added once)", got.detach(), want.detach())
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


def rank_checks(source: str, seed: int) -> dict[str, str | None]:
    """On every rank: run each check; None if it passed, else why it failed."""
    import torch.distributed as dist

    me = dist.get_rank()
    ex = _load(source)
    verdicts: dict[str, str | None] = {}
    for i, (name, check) in enumerate(CHECKS.items()):
        g = torch.Generator().manual_seed(seed + i)  # the same draws on every rank
        try:
            check(ex, g, me)
            verdicts[name] = None
        except Exception as exc:
            tb = traceback.format_exc(limit=-3)
            verdicts[name] = f"rank {me}: {type(exc).__name__}: {exc}\n{tb}"
        dist.barrier()  # keep the ranks in step: a rank that failed early must not run ahead
    return verdicts


@pytest.fixture(scope="module")
def verdicts(impl: ModuleType) -> dict:
    from layer2_comm import launch  # the course's own launcher (3 local gloo ranks)

    seed = seeds.randrange(2**31)
    source = impl.__name__ if impl.__name__ == REFERENCE else impl.__file__
    try:
        reports = launch(rank_checks, WORLD, source, seed, backend="gloo",
                         timeout_s=LAUNCH_TIMEOUT_S)
    except RuntimeError as exc:  # a rank hung or died: every exercise-1 check fails
        return {"error": f"the ranks did not finish (seed {seed}): {str(exc)[-1500:]}"}
    return {"seed": seed, "reports": reports}


def _verdict(verdicts: dict, name: str) -> None:
    if "error" in verdicts:
        pytest.fail(verdicts["error"], pytrace=False)
    failures = [r[name] for r in verdicts["reports"] if r[name]]
    if failures:
        pytest.fail(f"seed {verdicts['seed']}: {failures[0]}", pytrace=False)


@pytest.mark.points(10)
@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
def test_f_copy_to_tp_region(verdicts):
    _verdict(verdicts, "f")


@pytest.mark.points(10)
@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
def test_g_reduce_from_tp_region(verdicts):
    _verdict(verdicts, "g")


@pytest.mark.points(15)
@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
def test_column_parallel_linear(verdicts):
    _verdict(verdicts, "column")


@pytest.mark.points(15)
@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
def test_row_parallel_linear(verdicts):
    _verdict(verdicts, "row")


@pytest.mark.points(10)
@pytest.mark.timeout(RANK_TEST_TIMEOUT_S)
def test_column_then_row_mlp(verdicts):
    _verdict(verdicts, "mlp")


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


def _qkv(g, B=2, H=4, Hkv=4, n=7, m=9, D=8):
    return (torch.randn(B, H, n, D, generator=g), torch.randn(B, Hkv, m, D, generator=g),
            torch.randn(B, Hkv, m, D, generator=g))


def _gen() -> tuple[torch.Generator, int]:
    seed = seeds.randrange(2**31)
    return torch.Generator().manual_seed(seed), seed


def _block_check(impl, g, seed, causal, **shape):
    q, k, v = _qkv(g, **shape)
    q_pos = torch.randperm(40, generator=g)[: q.shape[2]]
    k_pos = torch.randperm(40, generator=g)[: k.shape[2]]
    q_pos[0] = -1  # this query sees no key at all under the causal mask
    out, lse = impl.attention_block(q, k, v, q_pos, k_pos, causal=causal)
    want_out, want_lse = _softmax_attention(q, k, v, q_pos, k_pos, causal)
    where = f"(seed {seed}, causal={causal}, shapes {shape or 'default'})"
    assert not out.isnan().any() and not lse.isnan().any(), f"NaN in the result {where}"
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5, msg=f"lse {where}")
    torch.testing.assert_close(out.float(), want_out, rtol=1e-4, atol=1e-5, msg=f"out {where}")


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
    q, k, v = _qkv(g, m=12)
    q_pos, k_pos = torch.arange(5, 12), torch.randperm(12, generator=g)
    a, b = k_pos[:5], k_pos[5:]
    oa, la = _softmax_attention(q, k[:, :, :5], v[:, :, :5], q_pos, a)
    ob, lb = _softmax_attention(q, k[:, :, 5:], v[:, :, 5:], q_pos, b)
    out, lse = impl.merge_partial(oa, la, ob, lb)
    want_out, want_lse = _softmax_attention(q, k, v, q_pos, k_pos)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-5, msg=f"lse (seed {seed})")
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5, msg=f"out (seed {seed})")
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
