"""Lab 1 grader: a Triton softmax, RMSNorm and tiled matmul, and a CUDA C tiled SGEMM.

Graded through the `impl` fixture (tests/labs/conftest.py): the layer1_kernels package under
plain pytest, a student's exercises.py under `stack grade --lab 1`. The Triton kernels run
compiled on a GPU and through Triton's interpreter on a CPU (small, awkward shapes keep that
fast: every size is a non-multiple of the usual block sizes). The CUDA kernel is compiled
by nvcc on any machine that has it (no GPU needed) and run through CuPy on a GPU, on sizes
that are not multiples of its tile; without a GPU (or nvcc) those checks are reported "not
graded here" and the score is out of what was graded.

How "just call torch" is caught (`graded`, used by every Triton test):
1. While the graded function runs, a TorchDispatchMode sees every torch operation that
   reaches ATen, however it was spelled (torch.softmax, Tensor.softmax, F.softmax, `@`,
   torch.mm, F.rms_norm, x.exp(), x.pow(2).mean(), torch.rsqrt, ...). Only operations that
   allocate, view, copy or cast tensors are allowed (ALLOWED_OPS): enough to prepare
   arguments and outputs, never enough to compute the answer. Reading values out to Python
   or numpy (item, tolist, numpy, __array__, __dlpack__) is refused too.
2. Launching a Triton kernel suspends that check for the launch itself (Triton's launcher,
   and its interpreter, copy tensors with torch), and records which module defined the
   kernel. The graded call must launch at least one kernel defined in the graded source
   (the submission file, or layer1_kernels for the reference): a dummy kernel beside a
   torch computation fails (1), and borrowing another package's kernel fails (2).
A whitelist is robust where a blacklist is not: there are many ways to spell a softmax in
torch, but none of them is `empty_like` or `view`. Deliberately defeating the grader (e.g.
disabling the mode, reading raw memory) is out of scope: that is for a human to see.
The same checks hold for the reference, whose Triton paths only allocate, view and copy.
"""
from __future__ import annotations

import inspect
import random
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The layer's interpreter fixes (Triton 3.6's interpreter under numpy >= 2.4) apply to every
# kernel this process interprets, the submission's included, as they do in the notebook.
import layer1_kernels.interpreter  # noqa: F401, E402

REFERENCE = "layer1_kernels"

rng = random.Random()  # fresh inputs every run: an answer must be right for any valid input
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"

# ---------------------------------------------------------------- the anti-shortcut guard
#: ATen operations a graded function may run outside its kernels: allocation, views,
#: copies and casts. Anything that computes (exp, max, sum, mm, _softmax, rsqrt, ...) is not.
ALLOWED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "full", "full_like", "fill_", "zero_",
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "t", "transpose",
    "permute", "expand", "unsqueeze", "squeeze", "flatten", "unflatten", "slice", "select",
    "alias", "detach", "lift_fresh", "contiguous", "clone", "copy_", "_to_copy", "to", "set_",
})


class ShortcutError(AssertionError):
    """The graded function computed with torch (or Python/numpy) instead of a kernel."""


class _Guard(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.in_kernel = 0  # > 0 while a Triton launch is running: anything goes there

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_kernel and name not in ALLOWED_OPS:
            raise ShortcutError(
                f"torch computed aten.{name} outside your Triton kernels: the math must "
                "happen inside a @triton.jit kernel you wrote (allocating, viewing, "
                "copying and casting tensors is fine)")
        return func(*args, **(kwargs or {}))


def _launchers() -> list[type]:
    """Triton's classes whose `run` launches a kernel: a @triton.jit function (compiled or
    interpreted), and the autotune/heuristics wrappers around one (which also benchmark)."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.jit as jit

    classes = [jit.JITFunction, autotuner.Autotuner, autotuner.Heuristics]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


def graded(module: ModuleType, name: str, /, *args, **kwargs):
    """module.<name>(*args, **kwargs) under the guard (see the module docstring); returns its
    result after checking that it launched a Triton kernel defined in module's own source."""
    guard = _Guard()
    launched: list[str] = []

    def leave_python(what: str) -> Callable:
        original = getattr(torch.Tensor, what)

        def refuse(self, *a, **k):
            if guard.in_kernel:
                return original(self, *a, **k)
            raise ShortcutError(f"Tensor.{what}() moved data out of torch to compute with: "
                                "the math must happen inside your Triton kernels")
        return refuse

    def counting(original: Callable) -> Callable:
        def run(self, *a, **k):
            fn = getattr(self, "fn", None)
            if inspect.isfunction(fn):  # the @triton.jit function itself, not a wrapper
                launched.append(fn.__module__ or "")
            guard.in_kernel += 1
            try:
                return original(self, *a, **k)
            finally:
                guard.in_kernel -= 1
        return run

    with pytest.MonkeyPatch.context() as mp:
        for cls in _launchers():
            mp.setattr(cls, "run", counting(cls.run))
        for what in ("numpy", "tolist", "__array__", "__dlpack__"):
            mp.setattr(torch.Tensor, what, leave_python(what))
        with guard:
            out = getattr(module, name)(*args, **kwargs)
    own = module.__name__.split(".")[0]
    ours = [m for m in launched if m.split(".")[0] == own]
    assert ours, (f"{name} launched no Triton kernel defined in the graded file "
                  f"(launched: {sorted(set(launched)) or 'none'})")
    return out


# ---------------------------------------------------------------- helpers
def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, dtype=torch.float64)).to(dtype).to(DEVICE)


def poison(like: torch.Tensor | tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    """Fill and free a buffer of NaNs, so an output a kernel never writes is likely garbage
    (the allocator hands freed memory out again) rather than a stale right answer."""
    shape = like.shape if isinstance(like, torch.Tensor) else like
    torch.full(tuple(shape), float("nan"), dtype=dtype, device=DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), "the output has NaN or inf where the answer has none"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def awkward(low: int, high: int) -> int:
    """A size in [low, high] that is not a multiple of 16 (no block size divides it evenly)."""
    while True:
        n = rng.randint(low, high)
        if n % 16:
            return n


# ---------------------------------------------------------------- exercise 1: softmax
def _softmax64(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


def _check_softmax(impl, x: torch.Tensor, tol: float) -> torch.Tensor:
    poison(x, x.dtype)
    y = graded(impl, "softmax", x, impl="triton")
    assert isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, _softmax64(x)) < tol
    return y


@pytest.mark.points(10)
def test_softmax_matches_torch(impl):
    for shape in [(awkward(1, 40), awkward(2, 15)), (awkward(1, 20), awkward(33, 700)),
                  (2, awkward(1, 5), awkward(17, 300)), (rng.randint(1, 4), 1)]:
        x = randn(*shape, scale=3.0)
        y = _check_softmax(impl, x, 1e-5)
        torch.testing.assert_close(y.sum(-1), torch.ones(shape[:-1], device=DEVICE))


@pytest.mark.points(5)
def test_softmax_half_precision_and_masked_entries(impl):
    x = randn(awkward(2, 30), awkward(20, 200), dtype=torch.float16, scale=2.0)
    x[:, rng.randint(0, 9)::rng.randint(2, 5)] = -float("inf")  # attention-style masking
    y = _check_softmax(impl, x, 2e-3)
    masked = torch.isinf(x)
    assert (y[masked] == 0).all(), "masked (-inf) entries must get probability 0"


@pytest.mark.points(5)
def test_softmax_is_numerically_stable(impl):
    # exp(1e4) overflows: only a kernel that subtracts the row max gets these right.
    x = randn(awkward(3, 20), awkward(50, 400), scale=1e4)
    x[0] = 1e4  # a constant row of huge values: uniform probabilities
    y = _check_softmax(impl, x, 1e-5)
    torch.testing.assert_close(y[0], torch.full_like(y[0], 1 / x.shape[1]))


@pytest.mark.points(5)
def test_softmax_long_rows(impl):
    x = randn(rng.randint(2, 3), awkward(5000, 9000), scale=3.0)
    _check_softmax(impl, x, 1e-5)


# ---------------------------------------------------------------- exercise 2: RMSNorm
def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.points(10)
def test_rms_norm_matches_torch(impl):
    for shape in [(awkward(1, 40), awkward(2, 300)), (2, awkward(1, 5), awkward(17, 1000))]:
        hidden = shape[-1]
        x, w = randn(*shape), randn(hidden)
        x[0] *= 1e-3  # a row so small that eps matters: eps belongs inside the sqrt
        eps = rng.choice([1e-6, 1e-5, 1e-3])
        poison(x)
        y = graded(impl, "rms_norm", x, w, eps=eps, impl="triton")
        assert isinstance(y, torch.Tensor) and y.dtype == x.dtype
        assert rel_err(y, _rms64(x, w, eps)) < 1e-5
        assert rel_err(y[0], _rms64(x[0], w, eps)) < 1e-5


@pytest.mark.points(5)
def test_rms_norm_half_precision(impl):
    x = randn(awkward(2, 30), awkward(40, 500), dtype=torch.float16)
    w = randn(x.shape[-1], dtype=torch.float16)
    poison(x, torch.float16)
    y = graded(impl, "rms_norm", x, w, eps=1e-6, impl="triton")
    assert y.dtype == torch.float16
    assert rel_err(y, _rms64(x, w, 1e-6)) < 3e-3


def _rms16_ways(h: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """RMSNorm of fp16 h, exactly rounded, in the two usual arithmetics: HF LlamaRMSNorm's
    (h * rstd rounded to fp16, then times w) and one rounding at the end."""
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    return (w.double() * normed.half().double()).half(), (normed * w.double()).half()


@pytest.mark.points(10)
def test_rms_norm_fused_residual(impl):
    for dtype, tol in [(torch.float32, 1e-5), (torch.float16, 3e-3)]:
        # a residual stream r and a smaller block output x: h = x + r must round to fp16
        x = randn(awkward(8, 30), awkward(100, 400), dtype=dtype, scale=0.3)  # >= 800 values
        r, w = randn(*x.shape, dtype=dtype, scale=3.0), randn(x.shape[-1], dtype=dtype)
        x_before, r_before = x.clone(), r.clone()
        poison(x, dtype)
        out = graded(impl, "rms_norm", x, w, eps=1e-6, residual=r, impl="triton")
        assert isinstance(out, tuple) and len(out) == 2, "with a residual, return (y, h)"
        y, h = out
        assert y.dtype == h.dtype == dtype
        torch.testing.assert_close(h, x + r)  # h is the new residual stream, x + r
        assert rel_err(y, _rms64(x + r, w, 1e-6)) < tol
        assert torch.equal(x, x_before) and torch.equal(r, r_before), "inputs must not change"
        if dtype == torch.float16:  # y normalises h as stored (rounded), not the fp32 sum:
            # a difference under one unit in the last place, so compare bit for bit with
            # either usual arithmetic; an unrounded h agrees with neither on ~1/4 of values
            agree = max((y == want).float().mean().item() for want in _rms16_ways(x + r, w, 1e-6))
            assert agree > 0.98, (
                f"y agrees with RMSNorm of the fp16 h you return on {agree:.0%} of its values: "
                "normalise h rounded to fp16 (what the next layer reads), not the fp32 x + r")


# ---------------------------------------------------------------- exercise 3: tiled matmul
#: fp32 on a GPU goes through tf32 tensor cores (~1e-3 relative); the interpreter is exact.
MATMUL_TOL = 1e-5 if INTERPRETED else 5e-3


def _check_matmul(impl, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    poison((a.shape[0], b.shape[1]), a.dtype)
    c = graded(impl, "matmul", a, b, impl="triton")
    assert isinstance(c, torch.Tensor) and c.dtype == a.dtype
    assert rel_err(c, a.double() @ b.double()) < tol


@pytest.mark.points(15)
def test_matmul_matches_torch(impl):
    shapes = [(awkward(17, 90), awkward(17, 90), awkward(17, 90)),  # (M, K, N)
              (rng.randint(1, 8), awkward(20, 100), awkward(20, 100)),  # a decode-like skinny M
              (awkward(20, 70), rng.randint(1, 12), awkward(20, 70))]  # K shorter than a block
    for m, k, n in shapes:
        _check_matmul(impl, randn(m, k), randn(k, n), MATMUL_TOL)


@pytest.mark.points(5)
def test_matmul_half_precision(impl):
    m, k, n = awkward(17, 80), awkward(17, 80), awkward(17, 80)
    _check_matmul(impl, randn(m, k, dtype=torch.float16), randn(k, n, dtype=torch.float16), 5e-3)


@pytest.mark.points(10)
def test_matmul_reads_strided_views(impl):
    m, k, n = awkward(17, 70), awkward(17, 70), awkward(17, 70)
    a_t = randn(k, m).T  # a transposed view: stride (1, m)
    b_wide = randn(k, 2 * n)[:, ::2]  # every other column: stride (2n, 2)
    assert not a_t.is_contiguous() and not b_wide.is_contiguous()
    _check_matmul(impl, a_t, b_wide, MATMUL_TOL)


# ---------------------------------------------------------------- exercise 4: CUDA SGEMM
KERNEL = "sgemm_smem_tiled"
TILE = 32


def _nvcc(source: Path, target: str, *extra: str) -> subprocess.CompletedProcess:
    out = source.with_suffix(f".{target}")
    cmd = [shutil.which("nvcc"), "-arch=sm_90", f"--{target}", "-std=c++17", *extra,
           "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"nvcc could not compile your kernel:\n{proc.stderr[-1500:]}"
    return proc


@pytest.mark.points(10)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH (no CUDA toolkit)")
def test_sgemm_source_compiles_with_shared_memory_tiles(impl, tmp_path):
    """nvcc (no GPU needed) compiles the kernel, and what it built has the right shape: the
    entry point the GPU test launches, two 32x32 float tiles of shared memory, a barrier."""
    source = impl.sgemm_source("smem_tiled")
    assert isinstance(source, str) and "__global__" in source
    assert "#include" not in source, "keep the source self-contained (CuPy compiles it with NVRTC)"
    path = tmp_path / "sgemm_smem_tiled.cu"
    path.write_text(source)

    report = _nvcc(path, "cubin", "-Xptxas", "-v").stderr  # to sm_90 machine code
    smem = [int(n) for n in re.findall(r"(\d+) bytes smem", report)]
    assert smem and max(smem) >= 2 * TILE * TILE * 4, (
        f"expected >= {2 * TILE * TILE * 4} bytes of shared memory (a 32x32 float tile of A "
        f"and one of B); ptxas reports:\n{report}")

    ptx = path.with_suffix(".ptx")
    _nvcc(path, "ptx")
    text = ptx.read_text()
    entry = re.search(rf"\.entry\s+{KERNEL}\s*\(([^)]*)\)", text)
    assert entry, f'no extern "C" __global__ void {KERNEL}(...) in the compiled code'
    params = re.findall(r"\.param\s+\.(\w+)", entry.group(1))
    assert params == ["u32"] * 3 + ["u64"] * 3, (
        f"{KERNEL} must take (int M, int N, int K, const float* A, const float* B, float* C); "
        f"the compiled parameters are {params}")
    assert re.search(r"\b(bar|barrier)\.sync\b", text), "no __syncthreads() in the kernel"
    assert "ld.shared" in text, "the kernel never reads shared memory"


def _guarded(n: int, guard: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """A buffer of guard + n + guard float32 NaNs, the middle n set to `fill` (flattened)."""
    buf = torch.full((guard + n + guard,), float("nan"), device=DEVICE)
    if fill is not None:
        buf[guard:guard + n] = fill.reshape(-1)
    return buf


@pytest.mark.points(10)
@pytest.mark.gpu
def test_sgemm_runs_on_gpu(impl):
    """The kernel, compiled by CuPy (NVRTC) for this GPU and launched with block (32, 32) and
    grid (ceil(N / 32), ceil(M / 32)), computes C = A @ B for awkward shapes (no size a
    multiple of the tile: edge tiles are partial), gives the same bits when run again (a
    missing __syncthreads races), and touches nothing outside A, B and C: each lies between
    bands of NaN, so an unguarded load brings NaN into C and an unguarded store shows in
    C's bands."""
    cupy = pytest.importorskip("cupy", reason="CuPy is needed to run a CUDA C kernel")
    import numpy as np

    major, minor = torch.cuda.get_device_capability()
    module = cupy.RawModule(code=impl.sgemm_source("smem_tiled"),
                            options=(f"-arch=sm_{major}{minor}", "-std=c++17"))
    kernel = module.get_function(KERNEL)
    for m, k, n in [(1, 1, 1), (awkward(33, 200), awkward(33, 200), awkward(33, 200)),
                    (awkward(200, 600), awkward(17, 90), awkward(100, 300)),
                    (awkward(500, 900), awkward(500, 900), awkward(500, 900))]:
        a, b = randn(m, k), randn(k, n)
        guard = TILE * (max(m, n, k) + TILE)  # past the farthest write of unguarded edge tiles
        bufs = _guarded(m * k, guard, a), _guarded(k * n, guard, b), _guarded(m * n, guard)
        args = [cupy.asarray(buf[guard:]) for buf in bufs]
        grid = ((n + TILE - 1) // TILE, (m + TILE - 1) // TILE)
        results = []
        for _ in range(2):
            torch.cuda.synchronize()
            kernel(grid, (TILE, TILE), (np.int32(m), np.int32(n), np.int32(k), *args))
            cupy.cuda.Device().synchronize()
            results.append(bufs[2][guard:guard + m * n].view(m, n).clone())
        where = f"(M, K, N) = {(m, k, n)}"
        assert rel_err(results[0], a.double() @ b.double()) < 1e-5, f"wrong C for {where}"
        assert torch.equal(results[0], results[1]), (
            f"two runs gave different C for {where}: threads race (a missing __syncthreads "
            "between loading a tile and using it, or before overwriting it)")
        c_buf = bufs[2]
        assert c_buf[:guard].isnan().all() and c_buf[guard + m * n:].isnan().all(), (
            f"the kernel wrote outside C for {where}: guard the store (row < M, col < N)")
