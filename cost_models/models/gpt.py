"""GPT-2 (Radford et al. 2019) as a unit chain: learned token + position embeddings, pre-LN blocks, tied LM head.

Shapes follow the released GPT-2 checkpoints (and nanoGPT's `model.py`): biases on every Linear and LayerNorm,
GELU with the tanh approximation, vocabulary 50257 without padding, so the parameter counts match exactly
(gpt2-small 124,439,808).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.models.chain import UnitChain
from cost_models.models.positions import token_positions
from cost_models.records.base import Record, record


@record
class GPTConfig(Record):
    vocab_size: int
    max_seq_len: int
    dim: int
    n_layers: int
    n_heads: int
    dropout: float = 0.0
    tie_embeddings: bool = True
    attention: str = "fused"   # "fused": SDPA's fused kernel; "unfused": the score matrix materialized (below)


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = token_positions(idx.shape[1], idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)
        self.dropout = cfg.dropout
        self.unfused = cfg.attention == "unfused"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads are counted from the projection's output, not the config: under tensor parallelism this rank's
        # c_attn holds its share of the q, k and v heads (cost_models/records/tensor_parallel.py, as Megatron splits
        # it).
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = _unfused_attention(q, k, v, p) if self.unfused else F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                              dropout_p=p)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


def _unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal attention with the score matrix materialized, as Megatron-LM computed it before FlashAttention
    (Narayanan et al. 2021; megatron/model/transformer.py's CoreAttention): scores = baddbmm with the 1/sqrt(d)
    scale as alpha (here the causal mask rides in as the added bias; Megatron fused scale, mask and softmax in one
    kernel), softmax, dropout over the probabilities, then probabilities @ V. The same math as SDPA's, with the
    score matrix's memory traffic and bytes saved for backward (Korthikanti et al. 2022's 5as/h term)."""
    b, heads, s, d = q.shape
    mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = torch.baddbmm(mask.expand(b * heads, s, s), q.reshape(b * heads, s, d),
                           k.reshape(b * heads, s, d).transpose(1, 2), alpha=d ** -0.5)
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p, training=dropout_p > 0)
    return torch.bmm(probs, v.reshape(b * heads, s, d)).view(b, heads, s, d)


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTHead(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(UnitChain):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = GPTEmbedding(cfg)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.head = GPTHead(cfg)
        if cfg.tie_embeddings:
            # GPT-2 ties the output projection to the token embedding (one tensor, counted once).
            self.head.lm_head.weight = self.embed.wte.weight
        self.init_weights()
