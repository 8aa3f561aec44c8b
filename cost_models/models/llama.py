"""Llama 2 / Llama 3 (Touvron et al. 2023; Meta 2024) as a unit chain: RMSNorm, RoPE, SwiGLU, grouped-query
attention, untied output head.

Module names follow Meta's reference `model.py` and torchtitan (tok_embeddings, attention.wq/wk/wv/wo,
feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, output) so the parameter counts match the released
checkpoints exactly (llama2-7b 6,738,415,616; llama3-8b 8,030,261,248; llama3-70b 70,553,706,496).
RoPE tables are computed in each block's forward rather than stored as buffers, so every block is a
self-contained pipeline unit and meta-device builds need no buffer re-initialisation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.models.chain import UnitChain
from cost_models.models.positions import token_positions
from cost_models.records.base import Record, record


@record
class LlamaConfig(Record):
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype):
    """cos/sin of the rotary embedding (Su et al. 2021), rotate-half layout, shape (seq_len, head_dim), at the
    tokens' places in their sequence (positions.token_positions: under context parallelism, not 0 .. seq_len - 1)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(token_positions(seq_len, device, torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads are counted from the projections' outputs, not the config: under tensor parallelism this rank holds
        # its share of them (torchtitan's attention does the same with view(bs, seqlen, -1, head_dim)).
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(s, self.head_dim, self.rope_theta, x.device, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if k.shape[1] != q.shape[1]:  # grouped-query attention: repeat K/V as Meta's reference does
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x), `width` wide."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, width, bias=False)
        self.w2 = nn.Linear(width, dim, bias=False)
        self.w3 = nn.Linear(dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaHead(nn.Module):
    def __init__(self, dim: int, vocab_size: int, norm_eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class Llama(UnitChain):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = LlamaEmbedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.head = LlamaHead(cfg.dim, cfg.vocab_size, cfg.norm_eps)
        self.init_weights()
