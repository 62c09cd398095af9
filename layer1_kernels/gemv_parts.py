"""The GEMV's pieces for a kernel of the layer above that ends a GEMV its own way.

Layer 2's row-parallel GEMV sends its outputs to the peers from its epilogue (a tensor-parallel
all-reduce begun where the product ends); its K loop, prologues (SiLU-and-multiply, the PDL
wait) and tile configs must be this layer's, so that its y has the same bits as gemv's. The
Triton helpers are passed by name, as plain attributes (a kernel binds them to globals of its
own module: Triton resolves a called function through the caller's globals).
"""
from __future__ import annotations

from types import SimpleNamespace

from .gemv import _act_tile, _mac, _prologue, _unpack, _w_tile, config_for, pdl_early, pdl_launch

GEMV_PARTS = SimpleNamespace(
    w_tile=_w_tile, act_tile=_act_tile, prologue=_prologue, mac=_mac,  # @triton.jit helpers
    config_for=config_for, unpack=_unpack,  # (BLOCK_N, BLOCK_K, warps[, stages]) of a shape
    pdl_launch=pdl_launch, pdl_early=pdl_early,  # launch keywords as gemv's
    NONE=0, SILU=2,  # PROLOGUE values
)
