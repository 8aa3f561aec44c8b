"""Tensor helpers the profiler's passes share: a tensor's bytes, a module's captured inputs made fresh leaves or
cut to one sample, and the roots a backward starts from."""
from __future__ import annotations

import torch

from cost_models.models.losses import compute_loss
from cost_models.torch_compat.torch_private import tree_leaves, tree_map


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fresh(captured):
    """The captured inputs as new leaves, each float tensor requiring grad where the captured one did (the capture
    marks what training differentiates: units.Capture._leaf)."""
    def leaf(t):
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.is_floating_point() and t.requires_grad)
        return t
    return tree_map(leaf, captured)


def one_sample(captured, batch: int):
    """The captured inputs cut to the first sample (tensors whose leading dimension is the batch)."""
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else t,
                    captured)


def backward_roots(out, loss: str | None, target):
    if loss is not None:
        return [compute_loss(loss, out, target)]
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
