"""Activation bytes a rank holds for backward, measured during one step: the run's counterpart of the estimate's
activation term (cost_models.cost.estimate: the schedule's in-flight micro-batches times each stage's saved bytes, plus,
with recompute, one unit's saved bytes while it is recomputed).

What is counted, by storage (views share one), parameters left out, as the profiler counts a unit's saved bytes
(cost_models.profiling.counting):
- every tensor autograd saves for backward (torch.autograd.graph.saved_tensors_hooks: the hook's handle lives as
  long as autograd keeps the tensor, and is dropped when the node that saved it has run backward);
- in a checkpointed region (full recompute of a unit, or the selective recompute of the attention kernel), what the
  non-reentrant checkpoint keeps instead: the region's inputs, until the region's backward has finished;
- while such a region is recomputed in backward, the tensors the recomputation made that are still alive when it
  ends (what it keeps for the region's backward; its temporaries are gone by then). Checkpoint's own hooks hide
  those from saved_tensors_hooks, so a dispatch mode passed as the recompute context (torch.utils.checkpoint's
  context_fn) sees the ops instead.
A saved view of the step's own input batch or targets (a micro-batch is a slice of the rank's batch, which the
training loop holds for the whole step anyway) counts as the bytes it spans, not as the batch's whole storage,
as the profiler counts a unit's input (a tensor of its own). The peak of that sum over the step is the measured
activation bytes. Gradients, communication buffers and temporaries are not activations: they are other rows of the
estimate (buffers) or not modelled.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cost_models.torch_compat.torch_private import TorchDispatchMode, storage_id, storage_key, tree_leaves, view_base

_ACTIVE: list["ActivationMeter"] = []     # the meter of the step being measured, if any
# modules whose forward runs under checkpointed() (executor.stages.recomputed): their own forward hooks run outside
# the checkpoint, so a hook that would change what is saved (executor.sp_shard) must know
RECOMPUTED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (its storage is the rank's), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear saves weight.t()), FSDP2's gathered ones included."""
    return isinstance(t, nn.Parameter) or isinstance(view_base(t), nn.Parameter)


class _Held:
    """The handle autograd keeps in place of a saved tensor: while it lives, its storage counts."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "ActivationMeter", key: Any, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


def _unpack(handle: Any) -> torch.Tensor:
    return handle.tensor if isinstance(handle, _Held) else handle


class ActivationMeter:
    """Peak activation bytes over the steps run inside it (see the module doc). `modules`: the rank's modules, whose
    parameters (gathered or not) are left out of what a recomputation keeps."""

    def __init__(self, modules: Iterable[nn.Module], *, batch: Iterable[torch.Tensor] = ()) -> None:
        self.modules = list(modules)
        self.batch = {storage_id(_local(t)) for t in batch}   # storages of the step's inputs and targets
        self.live: dict[Any, list[int]] = {}      # storage (or batch storage and span) -> [handles alive, bytes]
        self.total = 0
        self.peak = 0
        self._lock = threading.Lock()             # on GPUs autograd frees saved tensors on its device threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t
        local = _local(t)
        return t if local.device.type == "meta" else _Held(self, self.hold(local), t)

    def hold(self, local: torch.Tensor) -> Any:
        """Count `local`'s storage (once however many handles hold it; a slice of the batch: the bytes it spans);
        returns its key for release()."""
        key: Any = storage_id(local)
        if key in self.batch:
            key = (key, local.storage_offset(), _span_bytes(local))
        with self._lock:
            entry = self.live.get(key)
            if entry is not None:
                entry[0] += 1
            else:
                nbytes = key[2] if isinstance(key, tuple) else local.untyped_storage().nbytes()
                self.live[key] = [1, nbytes]
                self.total += nbytes
                self.peak = max(self.peak, self.total)
        return key

    def release(self, key: Any) -> None:
        with self._lock:
            entry = self.live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]
                self.total -= entry[1]

    def recomputed(self, extra: int) -> None:
        """A recomputation ended keeping `extra` bytes beside what is held: a candidate for the peak."""
        with self._lock:
            self.peak = max(self.peak, self.total + extra)

    def parameter_storages(self) -> set[int]:
        return {storage_id(_local(p)) for m in self.modules for p in m.parameters()}


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from a view's first element to its last in its storage (its own bytes when it is a dense slice)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


class _Recomputation(TorchDispatchMode):
    """The recompute context of a checkpointed region while a meter is on: weak references to the storage of every
    tensor the recomputation's ops make; when it ends, those still alive (kept for the region's backward) are
    reported to the meter."""

    def __init__(self, meter: ActivationMeter) -> None:
        super().__init__()
        self.meter = meter
        self.made: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing.reductions import StorageWeakRef
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented        # DTensor runs it; its local ops come through here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.made.append((StorageWeakRef(storage), storage_key(storage), storage.nbytes()))
        return out

    def __exit__(self, *exc):
        skip = self.meter.parameter_storages() | set(self.meter.live)
        alive = {key: n for ref, key, n in self.made if not ref.expired() and key not in skip}
        self.meter.recomputed(sum(alive.values()))
        self.made.clear()
        return super().__exit__(*exc)


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a checkpointed region's input; its backward runs once the region's backward has made the input's
    gradient, which is when the checkpoint lets the input go: it releases the meter's hold then."""

    @staticmethod
    def forward(ctx, release: Callable[[], None], x: torch.Tensor) -> torch.Tensor:
        ctx.release = release
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.release()
        return None, grad


def checkpointed(fn: Callable, *args, **kwargs):
    """torch.utils.checkpoint (non-reentrant) of fn(*args, **kwargs); under an ActivationMeter, also what the
    checkpoint keeps (its inputs until the region's backward, its recomputation's kept tensors) is counted."""
    meter = _ACTIVE[-1] if _ACTIVE else None
    if meter is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    no_grad: list[Any] = []
    args = tuple(_held_input(meter, a, no_grad) for a in args)
    kwargs = {k: _held_input(meter, v, no_grad) for k, v in kwargs.items()}
    out = checkpoint(fn, *args, use_reentrant=False,
                     context_fn=lambda: (contextlib.nullcontext(), _Recomputation(meter)), **kwargs)
    if no_grad and isinstance(out, torch.Tensor) and out.requires_grad:
        def release_inputs() -> None:
            for k in no_grad:
                meter.release(k)
        # inputs that get no gradient (token ids): let go when the region's backward starts
        out = _ReleaseAfterBackward.apply(_once(release_inputs), out)
    return out


def _once(fn: Callable[[], Any]) -> Callable[[], None]:
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()
    return call


def _held_input(meter: ActivationMeter, x: Any, no_grad: list[Any]) -> Any:
    """Count a tensor input the checkpoint will keep; released once its gradient has been made (the keys of inputs
    that get none go into `no_grad`)."""
    if not isinstance(x, torch.Tensor) or _is_parameter(x) or _local(x).device.type == "meta":
        return x
    key = meter.hold(_local(x))
    if not x.requires_grad:
        no_grad.append(key)
        return x
    return _ReleaseAfterBackward.apply(_once(lambda: meter.release(key)), x)
