"""Resolve `--cluster`: `local` (probe this machine), a preset name, a cluster file (JSON or YAML), or `none`."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from cost_models.records.cluster import ClusterProfile
from cost_models.records.errors import ConfigError
from cost_models.records.files import ClusterFile
from cost_models.records.presets import PRESETS, preset
from cost_models.records.validate import validate_cluster

StatusFn = Callable[[str], None]
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20, "G": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot read size '{text}'; use e.g. 4096, 64K, 16M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_sizes(text: str) -> tuple[int, ...]:
    """'4K..64M' (powers of 4 from low to high) or a comma list '64K,1M,16M'."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        if lo <= 0 or hi < lo:
            raise ConfigError(f"--probe-sizes {text}: need 0 < low <= high")
        sizes = [lo]
        while sizes[-1] * 4 <= hi:
            sizes.append(sizes[-1] * 4)
        return tuple(sizes)
    listed = tuple(sorted(parse_size(t) for t in text.split(",") if t.strip()))
    if len(listed) < 2:
        raise ConfigError("--probe-sizes needs at least two sizes to fit latency and bandwidth")
    return listed


def check_cluster_args(spec: str, *, nodes: int | None, ranks: int | None) -> None:
    """Reject flag combinations that cannot work, before any slow profiling starts."""
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    if spec == "local" and nodes not in (None, 1):
        raise ConfigError("--nodes applies to presets and cluster files; probe several nodes with torchrun "
                          "(python -m cost_models.profiling.cluster_probe, see README)")
    if spec != "local" and ranks is not None:
        raise ConfigError("--ranks applies to --cluster local only")
    if ranks is not None and ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")


def resolve_cluster(spec: str, *, nodes: int | None = None, ranks: int | None = None, dtype: str = "fp32",
                    sizes: tuple[int, ...] | None = None, repeats: int = 5,
                    on_status: StatusFn | None = None) -> ClusterProfile | None:
    """`none` -> None; `local` -> probe this machine; a preset name; or a cluster file path."""
    check_cluster_args(spec, nodes=nodes, ranks=ranks)
    if spec == "none":
        return None
    if spec == "local":
        return probe_local(ranks=ranks, dtype=dtype, sizes=sizes, repeats=repeats, on_status=on_status)
    if spec in PRESETS:
        return preset(spec, nodes=nodes or 1)
    if Path(spec).exists():
        cluster = ClusterFile.load(spec).cluster
        if nodes:
            cluster = cluster.with_nodes(nodes)
            validate_cluster(cluster, spec)   # the scaled cluster: an inter-node link is needed now
        return cluster
    raise ConfigError(f"unknown --cluster '{spec}': use local, none, a preset ({', '.join(PRESETS)}) or a cluster file")


def probe_local(*, ranks: int | None, dtype: str, sizes: tuple[int, ...] | None, repeats: int = 5,
                on_status: StatusFn | None = None, gpus: bool = True) -> ClusterProfile:
    """Detect GPUs through NVML (or say there are none), then probe collectives and matmul on local ranks.
    `gpus=False`: CPU ranks whatever NVML sees (the caller has hidden the GPUs from torch)."""
    from cost_models.profiling.cluster_probe import DEFAULT_SIZES, ProbeConfig, build_cluster_profile, run_local_probe
    from cost_models.profiling.nvml_topology import detect_topology

    topology, note = detect_topology() if gpus else (None, None)
    notes = [note] if note else []
    if note and on_status:
        on_status(note)
    n = ranks or (len(topology.gpus) if topology else 4)
    if on_status:
        on_status(f"probing collectives on {n} local ranks")
    cfg = ProbeConfig(sizes=sizes or DEFAULT_SIZES, repeats=repeats, dtype=dtype)
    raw = run_local_probe(n, cfg)
    return build_cluster_profile(raw, topology=topology, notes=notes, dtype=dtype)
