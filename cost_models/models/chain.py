"""The unit-chain shape every zoo model has: `embed` -> `blocks[0..L-1]` -> `head`, one tensor between units."""
from __future__ import annotations

import torch
from torch import nn


class UnitChain(nn.Module):
    """Subclasses set `embed`, `blocks` (an nn.ModuleList) and `head`, then call init_weights(); forward runs them
    in order."""

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation (Radford et al. 2019; nanoGPT's `_init_weights`): Linear and Embedding weights
        N(0, 0.02), biases 0; norms (LayerNorm, RMSNorm) their own reset: scale 1, shift 0. Applied to every module
        by the constructor (init_weights), and per module by executor.materialize for models built on meta."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if (bias := getattr(module, "bias", None)) is not None:   # an Embedding has none
                nn.init.zeros_(bias)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()

    def init_weights(self) -> None:
        self.apply(self._init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
