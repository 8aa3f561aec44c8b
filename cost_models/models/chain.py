"""The unit-chain shape every zoo model has: `embed` -> `blocks[0..L-1]` -> `head`, one tensor between units."""
from __future__ import annotations

import torch
from torch import nn


class UnitChain(nn.Module):
    """Subclasses set `embed`, `blocks` (an nn.ModuleList) and `head`; forward runs them in order."""

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
