"""Asking the L2 for a byte range ahead of its use: Hopper's bulk prefetch.

`cp.async.bulk.prefetch.L2.global [addr], size` hands the range to the copy engine: no
register waits for it and there is no completion to wait for, so one thread of a program can
issue it and the program can exit at once. Only where HBM would otherwise be idle does it
pay: prefetches issued while the kernel before streams at full bandwidth compete with it (a
GEMV's own rows fetched before its PDL wait ran slower). sm_90 and later only: `usable`
says where the instruction may be compiled in; elsewhere callers leave it out.
"""
from __future__ import annotations

import torch

from . import interpreter  # noqa: F401  (must run before triton: sets TRITON_INTERPRET)

# isort: split
import triton
import triton.language as tl


@triton.jit
def l2_prefetch(base_ptr, offset, nbytes):
    """Ask the L2 for nbytes (a multiple of 16) from byte `offset` past base_ptr (both
    16-byte aligned): one bulk prefetch from the program's thread 0. (Its dummy result goes
    unused: the op is not pure, so the compiler keeps it.)"""
    addr = base_ptr.to(tl.int64, bitcast=True) + offset
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def usable(t: torch.Tensor) -> bool:
    """Whether kernels on t's device may issue the bulk prefetch: a Hopper (sm_90) or later
    GPU, compiled (Triton's interpreter runs no inline PTX)."""
    return (t.is_cuda and not interpreter.INTERPRETED
            and torch.cuda.get_device_capability(t.device)[0] >= 9)
