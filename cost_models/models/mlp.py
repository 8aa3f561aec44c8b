"""A deep residual MLP on (batch, seq, features) inputs: the smallest model that still has pipeline units,
used by tests and the fidelity suite as the "deep and narrow" shape with no attention."""
from __future__ import annotations

import torch
from torch import nn

from cost_models.models.chain import UnitChain
from cost_models.records.base import Record, record


@record
class MLPConfig(Record):
    in_dim: int
    dim: int
    hidden: int
    n_layers: int
    out_dim: int


class MLPBlock(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class DeepMLP(UnitChain):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.in_dim, cfg.dim)
        self.blocks = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, cfg.out_dim))
        self.init_weights()
