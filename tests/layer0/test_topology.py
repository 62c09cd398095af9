"""The `nvidia-smi topo -m` parser on hand-written samples shaped like real output."""
from __future__ import annotations

import pytest

from layer0_hardware import Topology, parse_nvidia_smi_topo, read_topology

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# Two NVLinked H100s; the header is underlined with ANSI codes as on a terminal.
TWO_GPUS = (
    "\x1b[4m\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-51,104-155\t0\t\tN/A\n"
    "GPU1\tNV18\t X \t0-51,104-155\t0\t\tN/A\n" + LEGEND
)

# Four PCIe GPUs on two sockets plus one NIC, with the NIC legend block.
FOUR_GPUS = """\
        GPU0    GPU1    GPU2    GPU3    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      PIX     SYS     SYS     NODE    0-23    0               N/A
GPU1    PIX      X      SYS     SYS     NODE    0-23    0               N/A
GPU2    SYS     SYS      X      PXB     SYS     24-47   1               N/A
GPU3    SYS     SYS     PXB      X      SYS     24-47   1               N/A
NIC0    NODE    NODE    SYS     SYS      X
""" + LEGEND + """
NIC Legend:

  NIC0: mlx5_0
"""


def test_two_gpus_nvlink():
    topo = parse_nvidia_smi_topo(TWO_GPUS)
    assert isinstance(topo, Topology)
    assert topo.devices == ["GPU0", "GPU1"]
    assert topo.links == {("GPU0", "GPU1"): "NV18", ("GPU1", "GPU0"): "NV18"}
    assert topo.nvlink_count("GPU0", "GPU1") == 18
    assert topo.link("GPU1", "GPU1") == "X"
    assert topo.legend["X"] == "Self"
    assert topo.legend["NV#"].startswith("Connection traversing a bonded set")
    assert set(topo.legend) == {"X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"}


def test_four_gpus_pcie_and_nic():
    topo = parse_nvidia_smi_topo(FOUR_GPUS)
    assert topo.devices == ["GPU0", "GPU1", "GPU2", "GPU3", "NIC0"]
    assert topo.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert len(topo.links) == 5 * 4  # every ordered pair of distinct devices
    assert topo.link("GPU0", "GPU1") == "PIX"
    assert topo.link("GPU2", "GPU3") == "PXB"
    assert topo.link("GPU1", "GPU2") == "SYS"
    assert topo.link("NIC0", "GPU0") == "NODE"
    assert topo.nvlink_count("GPU0", "GPU1") == 0
    assert topo.legend["NIC0"] == "mlx5_0"
    # Affinity columns are ignored, not mistaken for devices or links.
    assert all("0-23" not in v for v in topo.links.values())


def test_errors():
    with pytest.raises(ValueError, match="GPU0"):
        parse_nvidia_smi_topo("nothing here\n")
    with pytest.raises(ValueError, match="cells"):
        parse_nvidia_smi_topo("\tGPU0\tGPU1\nGPU0\t X\n")
    topo = parse_nvidia_smi_topo(TWO_GPUS)
    with pytest.raises(ValueError, match="no link"):
        topo.link("GPU0", "GPU7")


def test_read_topology_without_nvidia_smi(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert read_topology() is None
