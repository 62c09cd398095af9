"""Run Triton kernels on the CPU when there is no GPU.

Triton picks between compiling a kernel and interpreting it (with numpy) when the
kernel is *defined* (`@triton.jit`), by reading TRITON_INTERPRET. So this module must be
imported before any kernel module: `layer1_kernels/__init__.py` imports it first.
"""
from __future__ import annotations

import os

import torch

#: True when kernels run through Triton's interpreter (no CUDA device visible).
INTERPRETED: bool = not torch.cuda.is_available()

if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"


def _let_loops_run_to_runtime_bounds() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int(array), which
    numpy >= 2.4 refuses for 1-element arrays (triton-lang/triton#9171, fixed after 3.6):
    `for k in range(0, K, BLOCK)` then fails. Read the single element explicitly instead."""
    try:
        from triton.runtime import interpreter as triton_interpreter
    except ImportError:
        return
    original = getattr(triton_interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_llm_stack_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._llm_stack_patched = True
    triton_interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _let_loops_run_to_runtime_bounds()


def refuse_interpreted_bf16_dot(dtype: torch.dtype) -> None:
    """Triton 3.6's interpreter runs tl.dot on bf16 through numpy, which has no bf16: the
    products come out as garbage. Kernels that dot refuse rather than return wrong numbers."""
    if INTERPRETED and dtype == torch.bfloat16:
        raise ValueError("bf16 is not supported by Triton's CPU interpreter (its bf16 tl.dot is "
                         "wrong); use float32 or float16 on the CPU, or a CUDA GPU")


def kernel_device() -> torch.device:
    """The device Triton kernels run on here: CUDA if present, else the CPU (interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


#: The `impl` values every kernel op takes.
IMPLS = ("auto", "triton", "torch")


def use_triton(impl: str, tensor: torch.Tensor, op: str) -> bool:
    """True to run our Triton kernel for `op` on `tensor`; False for the torch reference.

    "auto": the kernel on CUDA tensors, the reference elsewhere (the interpreter is too slow
    for real CPU work); "triton": the kernel, which needs the tensor where kernels run here
    (kernel_device()); "torch": the reference. ValueError naming `op` for an unknown impl or
    a misplaced tensor.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: unknown impl {impl!r}; expected one of {IMPLS}")
    if impl == "torch":
        return False
    if impl == "auto":
        return tensor.is_cuda
    if tensor.device.type != kernel_device().type:
        raise ValueError(
            f"{op}: impl='triton' needs tensors on {kernel_device().type} here "
            f"(where Triton kernels run), got {tensor.device}"
        )
    return True
