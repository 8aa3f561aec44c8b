"""What a rank measures: bytes moved by collectives and p2p, and process memory."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cost_models.torch_compat.host import peak_rss_bytes
from cost_models.torch_compat.torch_private import TorchDispatchMode

# c10d op name -> what the product reports it as (full-buffer convention of cost_models.cost.comm)
_KINDS = {"allgather": "all_gather", "_allgather_base": "all_gather", "reduce_scatter": "reduce_scatter",
          "_reduce_scatter_base": "reduce_scatter", "allreduce": "all_reduce", "broadcast": "broadcast",
          "send": "p2p_send", "recv": "p2p_recv"}
# DTensor's collectives (tensor parallelism) are functional ops: name -> (kind, whether the full buffer is the
# input times the group size: all_gather's input is one rank's part)
_FUNCTIONAL = {"all_reduce": ("tp_all_reduce", False), "all_gather_into_tensor": ("tp_all_gather", True),
               "reduce_scatter_tensor": ("tp_reduce_scatter", False)}


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(y) for y in x)
    return 0


def _dtensor() -> type:
    from torch.distributed.tensor import DTensor
    return DTensor


class CommCounter(TorchDispatchMode):
    """Counts c10d collectives and p2p issued through the dispatcher (FSDP2, ZeroRedundancyOptimizer, pipelining,
    dist.*), and DTensor's tensor-parallel collectives as "tp_all_reduce", "tp_all_gather", "tp_reduce_scatter":
    per kind, calls and bytes of the full buffer (the largest tensor argument; an all-gather's output). DDP's reducer calls
    gloo/NCCL from C++ and is not seen here; the executor counts its buckets itself."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, _dtensor()) for t in types):
            # a DTensor op: let DTensor run it with this mode still on, so the collectives its redistributions
            # issue on the local tensors come through here (a mode that ran it would see none of them)
            return NotImplemented
        name = str(func.overloadpacket.__name__).rstrip("_")
        namespace = getattr(func, "namespace", "")
        if namespace == "c10d" and name == "alltoall_base":   # (output, input, ...): what this rank sends
            self.add("all_to_all", _bytes(args[1]))
        elif namespace == "c10d" and name in _KINDS:
            self.add(_KINDS[name], max((_bytes(a) for a in args), default=0))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind, gathers = _FUNCTIONAL[name]
            self.add(kind, _bytes(args[0]) * (int(args[1]) if gathers else 1))
        return func(*args, **(kwargs or {}))

    def add(self, kind: str, nbytes: int) -> None:
        kind = f"{_LABEL}_{kind}" if _LABEL else kind
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


_LABEL = ""   # comm_label's: a prefix for the kinds counted while it is set


@contextlib.contextmanager
def comm_label(label: str) -> Iterator[None]:
    """Count the collectives issued inside as "<label>_<kind>" (context parallelism's gathers of keys and values
    are all-gathers like FSDP2's, and are predicted apart). Process-wide, as autograd may run a backward's
    collectives on another thread."""
    global _LABEL
    before, _LABEL = _LABEL, label
    try:
        yield
    finally:
        _LABEL = before


def peak_memory_bytes() -> tuple[int, str]:
    """(peak bytes, what was measured): the CUDA caching allocator's peak on GPUs, the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "cuda max_memory_allocated"
    return peak_rss_bytes()

