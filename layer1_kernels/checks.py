"""`stack run --layer 1`: run every kernel once on this machine and check it.

Each check draws fresh random inputs at an awkward size (not a multiple of any block),
runs our kernel (impl="triton": compiled on a GPU, interpreted on a CPU) and the torch
reference in float64, and reports the relative error ||ours - ref|| / ||ref||.
CuPy kernels run only where CUDA and CuPy are; elsewhere the check says why it skipped.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cupy_support import CUDA_DIR, cupy_available, require_cupy
from .flash_attention import flash_attention, flash_attention_reference
from .int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8
from .interpreter import kernel_device
from .matmul import matmul, matmul_reference
from .norms import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .nvcc import compile_check, nvcc_available
from .reduction import reduce_sum, reduce_sum_reference
from .rope import apply_rope, rope_cache, rope_reference
from .sgemm import SGEMM_VERSIONS, sgemm, sgemm_reference
from .softmax import softmax, softmax_reference
from .swiglu import silu_and_mul, silu_and_mul_reference
from .vector_add import vector_add, vector_add_reference

#: Relative error allowed per input dtype. The checks feed fp32, which the interpreter
#: computes exactly (~1e-7) but a GPU multiplies in TF32 (10-bit mantissa: ~1e-3 seen on
#: an H100 for attention); a wrong index or mask gives errors of order 1.
TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class CheckResult:
    name: str
    shape: str
    rel_error: float | None  # None when skipped
    seconds: float
    note: str = ""

    @property
    def ok(self) -> bool | None:
        return None if self.rel_error is None else self.rel_error <= TOLERANCE[torch.float32]


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.double().cpu(), ref.double().cpu()
    if not torch.isfinite(ours).all():
        return float("inf")
    return ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=kernel_device())


def _checks() -> list[tuple[str, str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """(name, shape, fn returning (ours, reference)) for each Triton kernel."""
    def rope():
        q, k = _r(37, 4, 64), _r(37, 2, 64)
        cos, sin = rope_cache(64, 64, device=q.device)
        ref_q, ref_k = rope_reference(q.double(), k.double(), cos.double(), sin.double())
        out_q, out_k = apply_rope(q.clone(), k.clone(), cos, sin, impl="triton")
        ours = torch.cat([out_q.flatten(), out_k.flatten()])
        return ours, torch.cat([ref_q.flatten(), ref_k.flatten()])

    def attention(causal: bool):
        q, k, v = _r(2, 4, 45, 64), _r(2, 2, 70, 64), _r(2, 2, 70, 64)
        return (flash_attention(q, k, v, causal=causal, impl="triton"),
                flash_attention_reference(q.double(), k.double(), v.double(), causal=causal))

    def swiglu():
        t = _r(33, 2 * 1537)
        return silu_and_mul(t, impl="triton"), silu_and_mul_reference(t.double())

    def int8():
        x, w = _r(3, 100), _r(77, 100)
        w8, scale = quantize_int8(w)
        ours = int8_matmul(x, w8, scale, impl="triton")
        return ours, int8_matmul_reference(x.double(), w8, scale)

    x, y, res, w, b = _r(1000), _r(1000), _r(33, 1537), _r(1537), _r(1537)
    rows = _r(33, 1537)
    a, bm = _r(67, 93), _r(93, 45)
    def add():
        return vector_add(x, y, impl="triton"), vector_add_reference(x.double(), y.double())

    def norm_residual():
        ours = rms_norm(rows, w, residual=res, impl="triton")
        ref = rms_norm_reference(rows.double(), w.double(), residual=res.double())
        return torch.cat([t.flatten() for t in ours]), torch.cat([t.flatten() for t in ref])

    def layer_norm_pair():
        ref = layer_norm_reference(rows.double(), w.double(), b.double())
        return layer_norm(rows, w, b, impl="triton"), ref

    return [
        ("vector_add", "1000", add),
        ("softmax", "33x1537",
         lambda: (softmax(rows, impl="triton"), softmax_reference(rows.double()))),
        ("rms_norm + residual", "33x1537", norm_residual),
        ("layer_norm", "33x1537", layer_norm_pair),
        ("rope (q and k in place)", "37 tokens, 4/2 heads, d=64", rope),
        ("silu_and_mul", "33x(2*1537)", swiglu),
        ("matmul", "67x93x45",
         lambda: (matmul(a, bm, impl="triton"), matmul_reference(a.double(), bm.double()))),
        ("flash_attention", "B=2 Hq=4 Hkv=2 Nq=45 Nk=70 d=64", lambda: attention(False)),
        ("flash_attention causal", "B=2 Hq=4 Hkv=2 Nq=45 Nk=70 d=64", lambda: attention(True)),
        ("int8_matmul (W8A16)", "3x100 @ (77x100)^T", int8),
    ]


def _cuda_checks() -> list[tuple[str, str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    checks = []
    for version in SGEMM_VERSIONS:
        def run(version=version):
            a, b = _r(127, 65), _r(65, 33)
            return sgemm(a, b, version=version), sgemm_reference(a.double(), b.double())
        checks.append((f"CuPy sgemm {version}", "127x65x33", run))
    x = _r(1_000_003)
    checks.append(
        ("CuPy reduce_sum", "1000003", lambda: (reduce_sum(x), reduce_sum_reference(x.double())))
    )
    return checks


def run_checks() -> list[CheckResult]:
    """Run every check once; never raises for a kernel's failure (it is reported)."""
    results = []
    for name, shape, fn in _checks():
        results.append(_run(name, shape, fn))
    if cupy_available():
        results += [_run(name, shape, fn) for name, shape, fn in _cuda_checks()]
    else:
        try:
            require_cupy()
        except RuntimeError as exc:
            results.append(CheckResult("CuPy "
                                       "kernels (reduction, SGEMMs)", "-", None, 0.0, str(exc)))
        results.append(_compile_sources())
    return results


def _compile_sources() -> CheckResult:
    """Without a GPU the CUDA C still gets compiled, so a syntax error shows here too."""
    sources = sorted(CUDA_DIR.glob("*.cu"))
    name = f"nvcc: {len(sources)} CUDA C sources for sm_90"
    if not nvcc_available():
        return CheckResult(name, "-", None, 0.0, "skipped: nvcc is not on the PATH")
    start = time.perf_counter()
    try:
        for source in sources:
            compile_check(source)
    except RuntimeError as exc:
        return CheckResult(name, "-", float("inf"), time.perf_counter() - start, str(exc))
    return CheckResult(name, "compiled, not run", 0.0, time.perf_counter() - start)


def _run(name: str, shape: str, fn) -> CheckResult:
    start = time.perf_counter()
    try:
        ours, ref = fn()
        error, note = relative_error(ours, ref), ""
    except Exception as exc:  # report, keep going
        error, note = float("inf"), f"{type(exc).__name__}: {exc}"
    return CheckResult(name, shape, error, time.perf_counter() - start, note)
