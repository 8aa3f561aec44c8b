"""GPU topology through NVML (nvidia-ml-py, module `pynvml`): devices, PCIe, NVLink, and how each pair connects.

`detect_topology(nvml)` takes the NVML module as a parameter so tests can hand in a fake; without a driver it
returns no topology and one line that says so.
"""
from __future__ import annotations

from typing import Any

from cost_models.records.cluster import GpuInfo, GpuPair, Topology

# nvmlDeviceGetTopologyCommonAncestor levels (nvml.h, nvmlGpuTopologyLevel_t) -> how a pair talks without NVLink.
_ANCESTOR_KIND = {0: "same-board", 10: "pcie-switch", 20: "pcie-switch", 30: "pcie-hostbridge", 40: "numa-node", 50: "system"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(nvml: Any, fn_name: str, *args: Any) -> Any:
    fn = getattr(nvml, fn_name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _nvlinks(nvml: Any, handle: Any) -> list[tuple[int | None, str, bool]]:
    """Active links of one GPU as (version, remote PCI bus id, remote is an NVSwitch)."""
    links = []
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _try(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            continue
        version = _try(nvml, "nvmlDeviceGetNvLinkVersion", handle, link)
        remote = _try(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        remote_type = _try(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        links.append((version, _text(remote.busId).lower() if remote is not None else "", remote_type == switch_type))
    return links


def detect_topology(nvml: Any | None = None) -> tuple[Topology | None, str | None]:
    """Return (topology, note). With no NVIDIA driver: (None, one line saying so)."""
    if nvml is None:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError:
            return None, "nvidia-ml-py is not installed: no GPU topology; probing CPU ranks with gloo"
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return None, f"no NVIDIA driver (NVML: {exc}): no GPU topology; probing CPU ranks with gloo"
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return None, "NVML sees no GPUs: probing CPU ranks with gloo"
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus, links = [], []
        for i, h in enumerate(handles):
            dev_links = _nvlinks(nvml, h)
            links.append(dev_links)
            versions = [v for v, _, _ in dev_links if v is not None]
            gpus.append(GpuInfo(
                index=i, name=_text(nvml.nvmlDeviceGetName(h)), memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower(),
                pcie_gen=_try(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h),
                pcie_width=_try(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h),
                nvlinks=len(dev_links), nvlink_version=max(versions) if versions else None))
        through_switch = [any(sw for _, _, sw in dl) for dl in links]
        pairs = []
        for i in range(count):
            for j in range(i + 1, count):
                direct = sum(1 for _, remote, _ in links[i] if remote == gpus[j].pci_bus_id)
                if direct or (through_switch[i] and through_switch[j]):
                    kind = "nvlink"
                else:
                    level = _try(nvml, "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
                    kind = _ANCESTOR_KIND.get(level, "unknown") if level is not None else "unknown"
                pairs.append(GpuPair(a=i, b=j, kind=kind, nvlinks=direct))
        return Topology(gpus=tuple(gpus), pairs=tuple(pairs), nvswitch=any(through_switch)), None
    finally:
        _try(nvml, "nvmlShutdown")
