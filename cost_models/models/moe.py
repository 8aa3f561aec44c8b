"""A mixture-of-experts decoder as a unit chain: Llama's embedding, norms and head, attention (grouped-query, with
Qwen3's per-head q/k norms, or DeepSeek's multi-head latent attention), and in each block either a dense SwiGLU MLP
or a sparse MoE block (a router picking top-k of E routed experts per token, plus optional shared experts).

The MoE block has the shape transformers gives Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 (transformers 5's
`MixtralSparseMoeBlock`, `DeepseekV3MoE`): a `gate` router returning (logits, top-k weights, top-k indices), an
`experts` module holding every routed expert as stacked weights (`gate_up_proj` (E, 2F, H), `down_proj` (E, H, F))
and called as experts(hidden (tokens, H), top_k_index (tokens, k), top_k_weights (tokens, k)), and
`shared_experts`. The profiler recognises any module of that shape (cost_models.profiling.moe), and expert
parallelism cuts at the `experts` call.

Sizes of the zoo entries are the published ones (Mixtral: Jiang et al. 2024, "Mixtral of Experts", table 1 and the
released config; Qwen3-30B-A3B: Qwen team 2025, "Qwen3 Technical Report", table 2 and the released config.json;
DeepSeek-V3: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 4.2 and the released config.json).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cost_models.models.chain import UnitChain
from cost_models.models.llama import FeedForward, LlamaEmbedding, LlamaHead, rotate_half, rope_tables
from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError


@record
class MLAConfig(Record):
    """DeepSeek's multi-head latent attention (DeepSeek-AI 2024, "DeepSeek-V2", section 2.1): queries and keys /
    values pass through low-rank latents; a rotary part of the key is shared by every head."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int


@record
class MoEConfig(Record):
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int              # the dense MLP's width (the first `first_dense` blocks)
    expert_dim: int           # each routed (and shared) expert's width
    n_experts: int            # routed experts per MoE block
    top_k: int
    max_seq_len: int
    n_shared: int = 0         # shared experts (every token), each expert_dim wide (one MLP n_shared x expert_dim)
    first_dense: int = 0      # leading blocks with a dense MLP (DeepSeek-V3: 3)
    qk_norm: bool = False     # Qwen3's RMSNorm over each head's queries and keys
    mla: MLAConfig | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021) over the last dim of x (b, heads, s, d)."""
    cos, sin = rope_tables(x.shape[2], x.shape[-1], theta, x.device, x.dtype)
    return x * cos + rotate_half(x) * sin


class GQAttention(nn.Module):
    """Grouped-query attention with an explicit head width (Qwen3: 128 at dim 2048) and optional q/k norms."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        # grouped-query attention in the kernel (key/value heads not repeated: saved once per kv head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class LatentAttention(nn.Module):
    """Multi-head latent attention, module names as DeepSeek's released checkpoints (q_a_proj, q_a_layernorm,
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). Values are padded to the query/key width
    for the fused attention kernel and the padding dropped after, as transformers' DeepSeek-V3 does for flash
    attention."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.m, self.n_heads, self.rope_theta = m, cfg.n_heads, cfg.rope_theta
        qk = m.qk_nope_dim + m.qk_rope_dim
        self.q_a_proj = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(m.q_lora_rank, eps=cfg.norm_eps)
        self.q_b_proj = nn.Linear(m.q_lora_rank, cfg.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, m.kv_lora_rank + m.qk_rope_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(m.kv_lora_rank, eps=cfg.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.n_heads * (m.qk_nope_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * m.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        m = self.m
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, -1, m.qk_nope_dim + m.qk_rope_dim)
        q_nope, q_rope = q.transpose(1, 2).split((m.qk_nope_dim, m.qk_rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((m.kv_lora_rank, m.qk_rope_dim), dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, -1, m.qk_nope_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split((m.qk_nope_dim, m.v_head_dim), dim=-1)
        heads = q_nope.shape[1]
        k_rope = _rope(k_rope.view(b, 1, s, m.qk_rope_dim), self.rope_theta).expand(b, heads, s, m.qk_rope_dim)
        q = torch.cat((q_nope, _rope(q_rope, self.rope_theta)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        v = F.pad(v, (0, q.shape[-1] - m.v_head_dim))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., :m.v_head_dim]
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class TopKRouter(nn.Module):
    """Softmax over the experts, the top k kept and renormalised (Mixtral's router; transformers'
    MixtralTopKRouter returns the same triple)."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, index = torch.topk(logits.float().softmax(dim=-1), self.top_k, dim=-1)
        return logits, (top / top.sum(dim=-1, keepdim=True)).to(x.dtype), index


def balanced_counts(assignments: int, n_experts: int) -> list[int]:
    """Tokens per expert when `assignments` token-expert pairs spread evenly (the first ones take the remainder)."""
    base, extra = divmod(assignments, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


def expert_order(top_k_index: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The token-expert pairs sorted by expert (a permutation of the flattened top_k_index) and the count per expert.
    On the meta device the routing is unknown: pairs in their own order and a balanced load (balanced_counts), so a
    meta profile counts the work of an even routing."""
    flat = top_k_index.reshape(-1)
    if flat.is_meta:
        return torch.arange(flat.numel(), device=flat.device), balanced_counts(flat.numel(), n_experts)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=n_experts).tolist()


class Experts(nn.Module):
    """Every routed expert of one block as stacked SwiGLU weights (transformers' MixtralExperts layout), run
    dropless: each token-expert pair goes through its expert, outputs weighted and summed per token."""

    meta_routing = True   # on meta, routes evenly (expert_order): a meta profile counts its work exactly

    def __init__(self, dim: int, width: int, n_experts: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * width, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, width))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=0.02)
        nn.init.normal_(self.down_proj, mean=0.0, std=0.02)

    def run(self, x: torch.Tensor, counts: list[int], weights: torch.Tensor) -> torch.Tensor:
        """Rows of x grouped by expert (counts[e] rows for expert e, in order) through their experts, each scaled
        by its routing weight (one per row). The weight scales the expert's inner activation, before the down
        projection (a linear map: the same product), so backward keeps that F-wide activation rather than the
        H-wide output. The stacked weights are unbound once: indexing them per expert would make each expert's
        gradient a zero-filled tensor of the whole stack (select's backward), E times the bytes."""
        if x.is_meta and len(set(counts)) == 1:   # an even routing on meta: one batched product per matrix, the
            # same FLOPs and shapes as the loop, without E small ops per block (a 256-expert model profiles in
            # seconds)
            e, r = len(counts), counts[0]
            gate, up = torch.bmm(x.view(e, r, -1), self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
            h = F.silu(gate) * up * weights.view(e, r, 1)
            return torch.bmm(h, self.down_proj.transpose(1, 2)).reshape(e * r, -1)
        outs = []
        for rows, w, w_in, w_out in zip(x.split(counts), weights.split(counts), self.gate_up_proj.unbind(0),
                                        self.down_proj.unbind(0)):
            gate, up = F.linear(rows, w_in).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up * w, w_out))
        return torch.cat(outs)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        order, counts = expert_order(top_k_index, self.num_experts)
        token = order // k
        y = self.run(hidden[token], counts, top_k_weights.reshape(-1)[order].unsqueeze(-1).to(hidden.dtype))
        return torch.zeros_like(hidden).index_add(0, token, y)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = TopKRouter(cfg.dim, cfg.n_experts, cfg.top_k)
        self.experts = Experts(cfg.dim, cfg.expert_dim, cfg.n_experts)
        self.shared_experts = (FeedForward(cfg.dim, cfg.n_shared * cfg.expert_dim) if cfg.n_shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(-1, h)
        _, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(b, s, h)


class MoEDecoderBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = LatentAttention(cfg) if cfg.mla is not None else GQAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MoEBlock(cfg) if cfg.is_moe(layer) else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(UnitChain):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = LlamaEmbedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(MoEDecoderBlock(cfg, i) for i in range(cfg.n_layers))
        self.head = LlamaHead(cfg.dim, cfg.vocab_size, cfg.norm_eps)
        self.init_weights()


def active_params(cfg: MoEConfig) -> int:
    """Parameters one token runs through: every parameter less the routed experts it is not sent to (each MoE
    block's E - k routed experts), as the published "activated parameters" count them."""
    idle = (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.expert_dim
    return total_params(cfg) - idle * sum(cfg.is_moe(i) for i in range(cfg.n_layers))


def total_params(cfg: MoEConfig) -> int:
    """Every parameter of MoETransformer(cfg), by formula (counted on meta in tests against the module)."""
    if cfg.mla is not None:
        m = cfg.mla
        qk = m.qk_nope_dim + m.qk_rope_dim
        attn = (cfg.dim * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * cfg.n_heads * qk
                + cfg.dim * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank
                + m.kv_lora_rank * cfg.n_heads * (m.qk_nope_dim + m.v_head_dim) + cfg.n_heads * m.v_head_dim * cfg.dim)
    else:
        attn = ((2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.dim
                + (2 * cfg.head_dim if cfg.qk_norm else 0))
    moe = (cfg.n_experts * 3 * cfg.dim * cfg.expert_dim + cfg.n_experts * cfg.dim
           + 3 * cfg.dim * cfg.expert_dim * cfg.n_shared)
    layers = sum(attn + 2 * cfg.dim + (moe if cfg.is_moe(i) else 3 * cfg.dim * cfg.ffn_dim)
                 for i in range(cfg.n_layers))
    return layers + 2 * cfg.vocab_size * cfg.dim + cfg.dim


ROUTERS = ("gate", "router")


def _top_k(block: nn.Module) -> Any:
    k = getattr(block, "top_k", None)
    if k is None:
        router = next((getattr(block, r) for r in ROUTERS if isinstance(getattr(block, r, None), nn.Module)), None)
        k = getattr(router, "top_k", None)
    return k


@dataclasses.dataclass(frozen=True)
class Block:
    """One mixture-of-experts block as moe_blocks found it."""

    name: str
    module: nn.Module
    experts: nn.Module
    n_experts: int
    top_k: int


def moe_blocks(model: nn.Module) -> list[Block]:
    """Every mixture-of-experts block, in module order; a block with a router and experts that does not declare
    integer `num_experts` (on its experts) and `top_k` is a one-line ConfigError."""
    out = []
    for name, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if not isinstance(experts, nn.Module) or not any(isinstance(getattr(m, r, None), nn.Module) for r in ROUTERS):
            continue
        n, k = getattr(experts, "num_experts", None), _top_k(m)
        if not (isinstance(n, int) and isinstance(k, int) and 0 < k <= n):
            raise ConfigError(
                f"{name or 'the model'} looks like a mixture-of-experts block (a router and `experts`) but does not "
                f"declare integer `num_experts` on its experts and `top_k` (1..num_experts) on it or its router "
                f"(found {n!r}, {k!r}); set both, so its routed work can be counted")
        out.append(Block(name=name, module=m, experts=experts, n_experts=n, top_k=k))
    return out


def check_meta_routing(model: nn.Module) -> None:
    """For a model on meta, a one-line ConfigError for a meta profile of MoE blocks whose experts route by data
    (transformers': their tokens per expert are picked with nonzero): only experts that route evenly on meta
    (`meta_routing`, the zoo's: expert_order) can be counted there."""
    if not any(p.is_meta for p in model.parameters()):
        return
    odd = next((b for b in moe_blocks(model) if not getattr(b.experts, "meta_routing", False)), None)
    if odd is not None:
        raise ConfigError(f"{odd.name}.experts ({type(odd.experts).__name__}) picks its tokens by data-dependent "
                          f"routing, which a meta profile cannot count; profile it in real mode (a smaller config), "
                          f"or plan with the zoo's mixtral-8x7b, qwen3-30b-a3b or deepseek-v3 (meta)")


@contextlib.contextmanager
def shape_only_experts(model: nn.Module) -> Iterator[None]:
    """For a forward on meta run for its shapes only: experts that route by data (not `meta_routing`) return zeros
    of their input's shape (the interface's output shape) instead of running."""
    patched = [b.experts for b in moe_blocks(model) if not getattr(b.experts, "meta_routing", False)]
    for e in patched:
        e.forward = lambda hidden, *args, **kwargs: torch.zeros_like(hidden)
    try:
        yield
    finally:
        for e in patched:
            del e.forward
