"""Which device a rank computes on and which backend its process group uses: one answer for the cluster probe, the
executor's ranks and users' scripts (apply_plan). GPU ranks run NCCL, one GPU each (LOCAL_RANK, as torchrun
numbers them); CPU ranks run gloo (torch.distributed docs, "Backends": NCCL for GPUs, gloo for CPUs)."""
from __future__ import annotations

import os

import torch


def rank_backend() -> str:
    """The process-group backend for this process's ranks."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank_device() -> torch.device:
    """The device this rank computes on: its current GPU when torch sees one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def claim_device(*, one_thread: bool) -> torch.device:
    """Make this rank's GPU (LOCAL_RANK) current; on CPU ranks with `one_thread`, compute on one thread, as the
    profile timed the units (ranks share the host's cores). Returns rank_device()."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif one_thread:
        torch.set_num_threads(1)
    return rank_device()
