"""The optimizers zeropipe trains with, built in one place for the executor and for the profiler that times them.

The executor's hyper-parameters (what a step costs depends only on the algorithm, not on lr): AdamW and Adam with
torch's defaults (foreach on CPU and GPU), SGD with momentum 0.9. A real-mode profile times each one's step on fp32
copies of the model's parameters (profile.OptimizerTiming): compute.optimizer_step_time prices a rank's update
from it where the profile's device is the cluster's.
"""
from __future__ import annotations

import statistics

import torch
from torch import nn

from cost_models.records.profile import OPTIMIZERS, OptimizerTiming, Timing
from cost_models.torch_compat.host import profile_clock

# parameters the profiler copies to time a step: enough for full-size tensors of any model here, and at most
# 16 B more per parameter (fp32 copy, gradient, two Adam moments) over this many beside the profiled model
TIMED_PARAMS_MAX = 8 * 2**20
TINY_TENSORS, TINY_NUMEL = 64, 64
BLOCKS = 3                           # timed blocks per optimizer (time_optimizers keeps the least median)
ALLOCATOR_WARM_BYTES = 16 * 2**20    # a block freed before timing, as a training step frees activations
FLUSH_BYTES = 128 * 2**20   # beyond a server CPU's L3 (tens of MiB) and a GPU's L2 (60 MiB on an H200)


def build(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The executor's optimizer `name` (strategy.optimizer) over `params`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=lr)


def _step_times(opt: torch.optim.Optimizer, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each timed step (the first steps, which create the optimizer's state, untimed), each after
    writing a buffer larger than the caches: in a training step the forward and backward have evicted the
    parameters, gradients and moments (a step after the flush takes longer than one repeated in a warm cache:
    benchmarks/results/measurements.md, "Optimizer step timing")."""
    flush = torch.empty(FLUSH_BYTES // 4, device=device)
    times = []
    clock = profile_clock()[0]
    for i in range(max(1, warmup) + repeats):
        flush.fill_(float(i))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= max(1, warmup):
            times.append(clock() - t0)
    return times


def _copies(tensors, device: torch.device) -> list[nn.Parameter]:
    out = []
    for t in tensors:
        p = nn.Parameter(t.detach().to(device=device, dtype=torch.float32, copy=True))
        p.grad = torch.randn_like(p)
        out.append(p)
    return out


def time_optimizers(model: nn.Module, device: torch.device, *, warmup: int, repeats: int,
                    max_params: int = TIMED_PARAMS_MAX) -> tuple[OptimizerTiming, ...]:
    """Every optimizer's step over fp32 copies of `model`'s parameters in order, up to `max_params` of them (the
    whole model where it is smaller; at least one tensor), and per tensor over tiny ones."""
    chosen: list[nn.Parameter] = []
    total = 0
    for p in model.parameters():
        if chosen and total + p.numel() > max_params:
            break
        chosen.append(p)
        total += p.numel()
    # A training step frees activations of several MiB, after which glibc's malloc serves such sizes from its heap
    # (its mmap threshold rises to the largest freed mapping, up to 32 MiB). A profile that has not freed one
    # yet maps fresh pages for every temporary of the update, and faults them in: a step that allocates a few MiB
    # then took over twice its time, and longer than the executor's steps with two ranks updating at once
    # (measured: benchmarks/results/measurements.md, "Optimizer step timing"). So free such a block first.
    torch.empty(ALLOCATOR_WARM_BYTES // 4).fill_(0.0)
    out = []
    for name in OPTIMIZERS:
        # the block with the least median: the allocator's state can still differ between blocks
        times = min((_step_times(build(name, _copies(chosen, device), 1e-3), device, warmup, repeats)
                     for _ in range(BLOCKS)), key=statistics.median)
        tiny = _copies([torch.zeros(TINY_NUMEL) for _ in range(TINY_TENSORS)], device)
        tensor_s = statistics.median(_step_times(build(name, tiny, 1e-3), device, warmup, repeats)) / TINY_TENSORS
        out.append(OptimizerTiming(optimizer=name, step=Timing(median_s=statistics.median(times), min_s=min(times),
                                                               max_s=max(times), repeats=len(times)),
                                   params=total, tensors=len(chosen), tensor_s=tensor_s))
    return tuple(out)
