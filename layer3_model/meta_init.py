"""Modules built on the meta device without their random init: `with meta_device(): ...`.

A module made under `torch.device("meta")` has no memory, but its reset_parameters still
draws (normal_, uniform_ on meta tensors). PyTorch runs those meta kernels as Python refs
behind a dynamo guard, so the first one imports torch._dynamo: ~2.5 s of CPU, once per
process, paid by every worker process of layer 5 that builds its part (a model built on meta,
then its tensors assigned). Under meta_device() those draws on meta tensors are skipped (the
tensors come back as they were: there are no values to fill), everything else runs as
under torch.device("meta").
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

#: in-place fills (nn.init's, and the tensor methods reset_parameters calls): no values on
#: meta, so nothing to do
_FILLS = {getattr(torch.nn.init, name) for name in (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_")} | {getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "bernoulli_", "cauchy_", "exponential_", "geometric_",
    "log_normal_", "random_", "fill_", "zero_")}


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS:  # nn.init passes its tensor by keyword
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """torch.device("meta"), less the random init of the modules made under it."""
    with _SkipMetaFills(), torch.device("meta"):
        yield
