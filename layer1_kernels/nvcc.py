"""Compile the CUDA C sources with nvcc, without a GPU: a syntax check for CI.

CuPy compiles the .cu files at run time with NVRTC, which only happens on a CUDA machine.
nvcc, CUDA's offline compiler, needs no GPU, so wherever it is installed we can at least
prove every source still compiles (to Hopper machine code, sm_90) and read the compiler's
resource report: registers per thread, spills, shared memory.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

#: The GPU architecture sources are checked against (Hopper: H100/H200).
DEFAULT_ARCH = "sm_90"


def nvcc_available() -> bool:
    """True when an `nvcc` executable is on PATH."""
    return shutil.which("nvcc") is not None


def _compile(path: str | Path, arch: str, target: str, extra: tuple[str, ...]) -> str:
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no CUDA source at {source}")
    if target not in ("ptx", "cubin"):
        raise ValueError(f"target must be 'ptx' or 'cubin', got {target!r}")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc is not on PATH; install the CUDA toolkit to compile .cu files")
    with tempfile.TemporaryDirectory(prefix="llm_stack_nvcc_") as tmp:
        out = Path(tmp) / f"{source.stem}.{target}"
        flags = [f"-arch={arch}", f"--{target}", "-std=c++17", *extra]
        cmd = [nvcc, *flags, "-o", str(out), str(source)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name} (exit {proc.returncode}):\n"
                               f"{' '.join(cmd)}\n{proc.stderr.strip()}")
        if not out.is_file():
            raise RuntimeError(f"nvcc wrote no {target} for {source.name}:\n{proc.stderr.strip()}")
        return proc.stderr


def compile_check(path: str | Path, *, arch: str = DEFAULT_ARCH, target: str = "cubin") -> None:
    """Compile one .cu file with nvcc (to cubin or PTX, in a temporary folder) and discard it.

    Raises RuntimeError carrying nvcc's error output when compilation fails, FileNotFoundError
    for a missing file. Needs nvcc on PATH (see `nvcc_available`), not a GPU.
    """
    _compile(path, arch, target, ())


def ptxas_report(path: str | Path, *, arch: str = DEFAULT_ARCH) -> str:
    """ptxas's resource report for each kernel in the file: registers, spills, shared memory.

    A kernel that spills (non-zero "spill stores") keeps part of its registers in slow local
    memory; one that uses many registers fits fewer blocks per SM.
    """
    report = _compile(path, arch, "cubin", ("-Xptxas", "-v"))
    lines = report.splitlines()
    return "\n".join(line for line in lines if "ptxas info" in line or "spill" in line)
