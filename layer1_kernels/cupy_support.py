"""CuPy plumbing for the CUDA C kernels: import CuPy lazily, compile .cu files, share memory
and streams with torch.

CuPy is optional. Importing this module never imports CuPy; `require_cupy()` does, and
raises a RuntimeError that says what is missing (the package, a GPU) where it cannot work.
Every public CuPy function in layer 1 calls it first, so on a laptop CPU they fail with that
one clear message and the torch references run instead.

Tensors cross between torch and CuPy without copies: `as_cupy(t)` wraps a torch CUDA
tensor's memory through `__cuda_array_interface__`, and kernels write into outputs that
torch allocated. Launches go on torch's current stream (`torch_stream`), so a CuPy kernel is
ordered with the torch work before and after it exactly as a torch op would be.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

#: The folder holding the CUDA C sources, one kernel (family) per file.
CUDA_DIR: Path = Path(__file__).with_name("cuda")

_MESSAGE = "CuPy kernels need a CUDA GPU and the cupy package: "


def _why_unavailable() -> str | None:
    """None when CuPy kernels can run here, else the reason they cannot."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return (f"cupy is not installed ({exc}); on a CUDA machine `pip install cupy-cuda12x` "
                "or `cupy-cuda13x`, matching the CUDA major version")
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (torch.cuda.is_available() is False)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError without a driver
        return f"cupy cannot reach the CUDA driver ({exc})"
    if count < 1:
        return "cupy sees no CUDA device"
    return None


@functools.lru_cache(maxsize=1)
def _cached_reason() -> str | None:
    return _why_unavailable()


def cupy_available() -> bool:
    """True when CuPy is installed and a CUDA GPU is visible to both CuPy and torch."""
    return _cached_reason() is None


def require_cupy() -> ModuleType:
    """Return the `cupy` module, or raise RuntimeError saying why CuPy kernels cannot run."""
    reason = _cached_reason()
    if reason is not None:
        raise RuntimeError(_MESSAGE + reason)
    return importlib.import_module("cupy")


def device_arch(device_index: int) -> str:
    """The device's compute capability as an -arch value, e.g. 'sm_90' for an H100."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def read_source(filename: str) -> str:
    """The text of layer1_kernels/cuda/<filename>."""
    path = CUDA_DIR / filename
    if not path.is_file():
        raise ValueError(f"no CUDA source {filename!r} in {CUDA_DIR}")
    return path.read_text()


@functools.cache
def _load(filename: str, options: tuple[str, ...], device_index: int) -> Any:
    cupy = require_cupy()
    # Compile for this exact GPU: -arch=sm_XX makes NVRTC emit its machine code (not only
    # PTX), so Hopper gets Hopper code. No -O3: NVRTC optimizes fully by default, and no
    # --use_fast_math, which would change rounding in kernels that do not need it.
    opts = (f"-arch={device_arch(device_index)}", "-std=c++17", *options)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=read_source(filename), options=opts)
        module.compile()  # compile now, so errors surface here and not at first launch
    return module


def load_module(filename: str, device_index: int, options: tuple[str, ...] = ()) -> Any:
    """Compile layer1_kernels/cuda/<filename> for a device into a `cupy.RawModule` (cached).

    Kernels in these files are `extern "C"`, so `module.get_function("name")` finds them by
    their plain names. `options` go to NVRTC after the -arch flag (e.g. "-DBK=16").
    """
    require_cupy()
    return _load(filename, tuple(options), device_index)


def get_kernel(filename: str, name: str, device_index: int,
               options: tuple[str, ...] = ()) -> Any:
    """The `cupy.RawKernel` called `name` from layer1_kernels/cuda/<filename>."""
    return load_module(filename, device_index, options).get_function(name)


def as_cupy(tensor: torch.Tensor) -> Any:
    """A CuPy array viewing the same device memory as a torch CUDA tensor (no copy)."""
    cupy = require_cupy()
    return cupy.asarray(tensor.detach())


@contextlib.contextmanager
def torch_stream(device: torch.device) -> Iterator[None]:
    """Make CuPy launch on the device and stream torch is currently using for `device`."""
    cupy = require_cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), _as_cupy_stream(cupy, stream, index):
        yield


def _as_cupy_stream(cupy: ModuleType, stream: torch.cuda.Stream, index: int) -> Any:
    # CuPy >= 14 wraps any object with the CUDA stream protocol (__cuda_stream__, which
    # torch streams have); older CuPy takes the raw cudaStream_t handle instead.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, index)


def check_tensor(name: str, tensor: object, dtypes: tuple[torch.dtype, ...]) -> None:
    """ValueError unless `tensor` is a torch tensor of one of `dtypes` (device checked later)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {names}; got "
                         f"{str(tensor.dtype).replace('torch.', '')}")


def check_on_cuda(name: str, tensor: torch.Tensor) -> None:
    """ValueError unless the tensor lives on a CUDA device (CuPy kernels cannot read host
    memory)."""
    if tensor.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor for the CuPy kernels; got device "
                         f"{tensor.device} (use the torch reference on the CPU)")
