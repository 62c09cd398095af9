"""How the GPUs in this box are wired to each other: parsing ``nvidia-smi topo -m``.

The matrix says, for every pair of devices, what a transfer between them crosses:
``NV#`` a bonded set of # NVLinks (fast, ~25 GB/s per link per direction on H100),
``PIX``/``PXB`` PCIe bridges only, ``PHB`` a PCIe host bridge (the CPU), ``NODE`` several
host bridges in one NUMA node, ``SYS`` the socket interconnect (slowest). Layer 2's
collective cost model reads this to pick bandwidths.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines/bolds the header on a tty
_DEVICE = re.compile(r"\b((?:GPU|NIC)\d+)\b")
_LEGEND_LINE = re.compile(r"^\s*(\S+)\s*[=:]\s*(.+?)\s*$")


@dataclass
class Topology:
    """Device labels, pairwise link types and the legend explaining them.

    devices: labels in matrix order, e.g. ["GPU0", "GPU1", "NIC0"].
    links: (a, b) -> link type such as "NV18", "PIX", "SYS", for every ordered pair a != b.
    legend: link type (or NIC label) -> explanation, from the text under "Legend:".
    """

    devices: list[str]
    links: dict[tuple[str, str], str] = field(default_factory=dict)
    legend: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> list[str]:
        """Just the GPU labels ("GPU0", ...), without NICs."""
        return [d for d in self.devices if d.startswith("GPU")]

    def link(self, a: str, b: str) -> str:
        """Link type between two devices; "X" for a device with itself."""
        if a == b:
            return "X"
        try:
            return self.links[(a, b)]
        except KeyError:
            raise ValueError(f"no link {a}<->{b}; devices are {self.devices}") from None

    def nvlink_count(self, a: str, b: str) -> int:
        """Number of bonded NVLinks between a and b (0 when the path is PCIe/SYS)."""
        match = re.fullmatch(r"NV(\d+)", self.link(a, b))
        return int(match.group(1)) if match else 0


def parse_nvidia_smi_topo(text: str) -> Topology:
    """Parse the text of ``nvidia-smi topo -m``.

    The header row names the device columns (GPU0, GPU1, ..., NIC0, ...) followed by
    columns such as "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID", which are ignored.
    Each device row starts with its label and has one cell per device column.
    Raises ValueError when no header is found or a row is malformed.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected the text of `nvidia-smi topo -m`, got {type(text).__name__}")
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    # The header is the first line naming GPU0; device rows follow it.
    header_idx = next((i for i, line in enumerate(lines) if "GPU0" in _DEVICE.findall(line)), None)
    if header_idx is None:
        raise ValueError("no header row naming GPU0 found in `nvidia-smi topo -m` output")
    columns = _DEVICE.findall(lines[header_idx])

    links: dict[tuple[str, str], str] = {}
    rows: list[str] = []
    i = header_idx + 1
    while i < len(lines) and lines[i].strip():
        cells = lines[i].split()
        label = cells[0]
        if not _DEVICE.fullmatch(label):
            break
        if len(cells) < 1 + len(columns):
            raise ValueError(f"row {label!r} has {len(cells) - 1} cells, expected {len(columns)}")
        for col, cell in zip(columns, cells[1:1 + len(columns)], strict=True):
            if col != label:
                links[(label, col)] = cell
        rows.append(label)
        i += 1
    if rows != columns:
        raise ValueError(f"rows {rows} do not match header columns {columns}")

    legend: dict[str, str] = {}
    for line in lines[i:]:
        match = _LEGEND_LINE.match(line)
        if match:
            legend[match.group(1)] = match.group(2)
    return Topology(devices=columns, links=links, legend=legend)


def read_topology(timeout_s: float = 10.0) -> Topology | None:
    """Run ``nvidia-smi topo -m`` and parse it; None without nvidia-smi or on any failure."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True,
                             timeout=timeout_s, check=True).stdout
        return parse_nvidia_smi_topo(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # topology is informative only; never fail introspection over it
