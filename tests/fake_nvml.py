"""FakeNvml: a stand-in for the `pynvml` module (this machine has no NVIDIA driver), named as a fake.

It answers the NVML calls cost_models.profiling.nvml_topology makes, for a made-up machine described in the constructor.
"""
from __future__ import annotations

from types import SimpleNamespace


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    NVMLError = FakeNvmlError
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def __init__(self, *, name: str, count: int, memory: int, links: dict[int, list[tuple[str, int]]],
                 ancestor: dict[tuple[int, int], int], pcie=(4, 16), fail_init: bool = False) -> None:
        # links: gpu -> [(remote bus id or "switch", nvlink version)]
        self.name, self.count, self.memory, self.links, self.ancestor = name, count, memory, links, ancestor
        self.pcie, self.fail_init, self.shutdown_called = pcie, fail_init, False

    def bus(self, i: int) -> str:
        return f"00000000:{0x10 + i:02X}:00.0"

    def nvmlInit(self):
        if self.fail_init:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.name.encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.memory, free=self.memory, used=0)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus(h).encode())

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self.pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self.pcie[1]

    def _link(self, h, link):
        dev = self.links.get(h, [])
        if link >= len(dev):
            raise FakeNvmlError("Not Supported")
        return dev[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._link(h, link)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return self._link(h, link)[1]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        remote = self._link(h, link)[0]
        return SimpleNamespace(busId=(f"00000000:{0xA0:02X}:00.0" if remote == "switch" else remote).encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        remote = self._link(h, link)[0]
        return self.NVML_NVLINK_DEVICE_TYPE_SWITCH if remote == "switch" else self.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor[(a, b)]


def dgx_h100() -> FakeNvml:
    """8 H100s, 18 NVLink-4 links each, all to NVSwitches."""
    return FakeNvml(name="NVIDIA H100 80GB HBM3", count=8, memory=81_559 * 2**20,
                    links={i: [("switch", 4)] * 18 for i in range(8)},
                    ancestor={(a, b): 50 for a in range(8) for b in range(8)}, pcie=(5, 16))


def pcie_box() -> FakeNvml:
    """8 L4s on PCIe only: GPUs 0-3 under one PCIe switch, 4-7 under another, on two CPU sockets."""
    ancestor = {}
    for a in range(8):
        for b in range(8):
            ancestor[(a, b)] = 20 if a // 4 == b // 4 else 50
    return FakeNvml(name="NVIDIA L4", count=8, memory=23_034 * 2**20, links={}, ancestor=ancestor)


def nvlink_pairs() -> FakeNvml:
    """4 GPUs with direct NVLink bridges 0-1 and 2-3 (4 links each), PCIe host bridge otherwise."""
    fake = FakeNvml(name="NVIDIA A100-PCIE-40GB", count=4, memory=40_960 * 2**20, links={},
                    ancestor={(a, b): 30 for a in range(4) for b in range(4)})
    fake.links = {0: [(fake.bus(1), 3)] * 4, 1: [(fake.bus(0), 3)] * 4, 2: [(fake.bus(3), 3)] * 4, 3: [(fake.bus(2), 3)] * 4}
    return fake
