"""Models defined outside the zoo, for `--model tests.custom_models:FACTORY` tests."""
import math

import torch
from torch import nn
import torch.nn.functional as F


class Gated(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 2 * d)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        return x + a * torch.sigmoid(b)


class ConvStack(nn.Module):
    """Features in, features out; no embedding, so its input comes from example_input or --input."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 24)
        self.layers = nn.ModuleList(Gated(24) for _ in range(3))
        self.out = nn.Linear(24, 5)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def make_model() -> nn.Module:
    return ConvStack()


def make_input(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randn(batch_size, seq_len, 12)


def broken_model() -> nn.Module:
    raise ValueError("out of coffee")


def not_a_model():
    return 42


class SkipBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, skip=None):
        y = torch.relu(self.fc(x))
        return y if skip is None else y + skip


class SkipNet(nn.Module):
    """Six blocks; block 1's output also feeds block 4 (a skip connection across units), U-Net style."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(SkipBlock(16) for _ in range(6))
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        x = self.stem(x)
        saved = None
        for i, block in enumerate(self.blocks):
            x = block(x, skip=saved if i == 4 else None)
            if i == 1:
                saved = x
        return self.out(x)

    def example_input(self, batch_size: int, seq_len: int):
        return torch.randn(batch_size, seq_len, 8)


def make_skipnet() -> nn.Module:
    return SkipNet()


class TinyLM(nn.Module):
    """Token ids in (its first module is an nn.Embedding, so the profiler makes int64 ids for it), logits out."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Gated(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_tiny_lm() -> nn.Module:
    return TinyLM()


class Pooled(nn.Module):
    """A vector per sample in, a class score out: no sequence axis (its input ignores seq_len)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(10, 10) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x

    def example_input(self, batch_size: int, seq_len: int):
        return torch.randn(batch_size, 10)


def make_pooled() -> nn.Module:
    return Pooled()


class ScaledLM(TinyLM):
    """TinyLM whose forward multiplies the embedding output by sqrt(d) (as Gemma and T5 do): work between units."""

    def forward(self, ids):
        x = self.emb(ids) * math.sqrt(self.emb.embedding_dim)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_scaled() -> nn.Module:
    return ScaledLM()


class PosNet(TinyLM):
    """TinyLM plus a learned position table (a root parameter, in no unit) added between the embedding and block 0."""

    def __init__(self, vocab: int = 50, d: int = 16, max_len: int = 128) -> None:
        super().__init__(vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_posnet() -> nn.Module:
    return PosNet()


class BufNet(TinyLM):
    """TinyLM whose forward scales block 0's output by a persistent buffer of the root (a mixing vector, saved in
    its state_dict and read between units, on no unit's stage by itself)."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__(vocab, d)
        self.register_buffer("mix", torch.linspace(0.5, 1.5, d))

    def forward(self, ids):
        x = self.blocks[0](self.emb(ids)) * self.mix
        return self.head(self.blocks[1](x))


def make_bufnet() -> nn.Module:
    return BufNet()


class PairOut(TinyLM):
    """TinyLM whose forward returns (logits, their mean): neither logits nor a loss training could take."""

    def forward(self, ids):
        logits = super().forward(ids)
        return logits, logits.mean()


def make_pair_out() -> nn.Module:
    return PairOut()


class KeyedBlocks(TinyLM):
    """TinyLM whose blocks live in an nn.ModuleDict keyed by name, run in the dict's order."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__(vocab, d)
        self.blocks = nn.ModuleDict({"early": Gated(d), "late": Gated(d)})

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)


def make_keyed_blocks() -> nn.Module:
    return KeyedBlocks()


class Residual2(TinyLM):
    """Four blocks; block 0's output is added again after block 2 (a residual kept across two units)."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__(vocab, d)
        self.blocks = nn.ModuleList(Gated(d) for _ in range(4))

    def forward(self, ids):
        x = self.blocks[0](self.emb(ids))
        kept = x
        x = self.blocks[2](self.blocks[1](x)) + kept
        x = self.blocks[3](x)
        return self.head(x)


def make_residual2() -> nn.Module:
    return Residual2()


class Looped(TinyLM):
    """ALBERT-style weight sharing across depth: block 0 runs again after block 1 (one unit, two depths). No stage
    can hold a unit that runs at two depths of a pipeline, so it is offered pp = 1 only."""

    def forward(self, ids):
        x = self.blocks[0](self.emb(ids))
        x = self.blocks[0](self.blocks[1](x))
        return self.head(x)


def make_looped() -> nn.Module:
    return Looped()


class _NanoBlock(nn.Module):
    """A pre-norm transformer block as single-file GPTs write it (causal self-attention through SDPA, a GELU MLP)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A GPT written the way the popular single-file GPTs write it: token and position tables, dropout, blocks and a
    final norm in an nn.ModuleDict, the head tied to the token table, and a forward that takes `targets` and returns
    (logits, loss), or the last position's logits and None when no targets are given (the inference branch)."""

    def __init__(self, vocab: int = 128, block_size: int = 32, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block_size, dim), drop=nn.Dropout(0.0),
            h=nn.ModuleList([_NanoBlock(dim, heads) for _ in range(layers)]), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def make_nanogpt() -> nn.Module:
    return NanoGPT()


def smoothed_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A declared loss (`planner run --loss`): cross-entropy with label smoothing 0.1 on the logits."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(), label_smoothing=0.1)


def per_token_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Not a loss training can take: one value per token, not their mean."""
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten(), reduction="none")


class RealOnly(TinyLM):
    """TinyLM whose forward refuses real tensors: profiles and launcher checks (meta) pass, every rank fails."""

    def forward(self, ids):
        if not ids.is_meta:
            raise RuntimeError("this model only runs on the meta device")
        return super().forward(ids)


def make_real_only() -> nn.Module:
    return RealOnly()


class LossOnly(TinyLM):
    """Takes targets and returns only its loss: no logits to size the targets by."""

    def forward(self, ids, targets=None):
        logits = super().forward(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) if targets is not None else logits


def make_loss_only() -> nn.Module:
    return LossOnly()


class MetaShy(TinyLM):
    """A forward with data-dependent code (`.item()`): it runs on real tensors only, never on the meta device."""

    def forward(self, ids):
        assert int(ids.max().item()) < self.emb.num_embeddings
        return super().forward(ids)


def make_meta_shy() -> nn.Module:
    return MetaShy()


class _UndeclaredMoE(nn.Module):
    """A mixture-of-experts block with a router and experts but no `num_experts` / `top_k` declared."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        choice = self.gate(x).argmax(-1, keepdim=True)
        outs = torch.stack([e(x) for e in self.experts], dim=-2)
        return x + outs.gather(-2, choice.unsqueeze(-1).expand(*choice.shape, x.shape[-1])).squeeze(-2)


class UndeclaredMoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(_UndeclaredMoE(16) for _ in range(2))
        self.out = nn.Linear(16, 64)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def undeclared_moe():
    return UndeclaredMoENet()


def qwen3_moe_4_layers():
    """The zoo's qwen3-30b-a3b cut to 4 of its 48 layers: the same blocks (128 experts, top-8), profiled in seconds."""
    import dataclasses

    from cost_models.models.moe import MoETransformer
    from cost_models.models.zoo import ZOO
    with torch.device("meta"):   # planning only: nothing to draw
        return MoETransformer(dataclasses.replace(ZOO["qwen3-30b-a3b"].config, n_layers=4))
