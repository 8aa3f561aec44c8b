"""The training loss each kind of model input implies, and a synthetic target for it.

Token models (zoo LMs, hf:, factories fed ids) are language models: next-token cross-entropy over the logits.
Feature models regress: mean squared error. The profiler includes the loss in the last unit (for an LM its
float logits and log-softmax are among the largest activations), and the executor trains with the same loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_kind(input_kind: str) -> str:
    return "cross_entropy" if input_kind == "tokens" else "mse"


def compute_loss(kind: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "cross_entropy":
        return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())
    return F.mse_loss(output.float(), target.float())


def synthetic_target(kind: str, output: torch.Tensor, *, seed: int = 4321) -> torch.Tensor:
    """A target shaped for `output` (class ids for cross-entropy, values for MSE), made on CPU with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "cross_entropy":
        target = torch.randint(0, output.shape[-1], tuple(output.shape[:-1]), generator=gen)
    else:
        target = torch.randn(tuple(output.shape), generator=gen)
    return target.to(output.device)
