"""The built-in zoo: named configurations of the GPT, Llama and deep-MLP unit chains.

Sizes are those of the published models (GPT-2: Radford et al. 2019, table 2; Llama 2: Touvron et al. 2023,
table 1 and the released params.json; Llama 3 / 3.1: Meta 2024, "The Llama 3 Herd of Models", table 3; the
mixtures of experts: cost_models.models.moe's module doc). The `*-tiny` and `mlp-deep` entries are small enough to
train on this CPU in seconds.
"""
from __future__ import annotations

from typing import Literal

from cost_models.models.gpt import GPT, GPTConfig
from cost_models.models.llama import Llama, LlamaConfig
from cost_models.models.mlp import DeepMLP, MLPConfig
from cost_models.models.moe import MLAConfig, MoEConfig, MoETransformer
from cost_models.records.base import Record, record

Config = GPTConfig | LlamaConfig | MLPConfig | MoEConfig


@record
class ZooEntry(Record):
    name: str
    family: Literal["gpt", "llama", "mlp", "moe"]
    description: str
    config: Config

    @property
    def input_kind(self) -> str:
        return "features" if self.family == "mlp" else "tokens"

    @property
    def max_seq_len(self) -> int | None:
        return None if isinstance(self.config, MLPConfig) else self.config.max_seq_len


def _gpt2(name: str, dim: int, n_layers: int, n_heads: int) -> ZooEntry:
    cfg = GPTConfig(vocab_size=50257, max_seq_len=1024, dim=dim, n_layers=n_layers, n_heads=n_heads)
    return ZooEntry(name=name, family="gpt", description=f"GPT-2 {n_layers}L d{dim}", config=cfg)


def _llama(name: str, *, vocab: int, dim: int, layers: int, heads: int, kv: int, ffn: int, ctx: int, theta: float) -> ZooEntry:
    """Llama 3 entries take Llama 3.1's context, 131,072 tokens (Meta 2024, "The Llama 3 Herd of Models", section
    3.4.2); its RoPE frequency scaling changes values only, not shapes or costs, and is not applied here."""
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                      max_seq_len=ctx, rope_theta=theta)
    return ZooEntry(name=name, family="llama", description=f"Llama {layers}L d{dim} {heads}h/{kv}kv ffn{ffn}", config=cfg)


def _moe(name: str, description: str, **config) -> ZooEntry:
    return ZooEntry(name=name, family="moe", description=description, config=MoEConfig(**config))


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    _gpt2("gpt2-small", 768, 12, 12),
    _gpt2("gpt2-medium", 1024, 24, 16),
    _gpt2("gpt2-large", 1280, 36, 20),
    _gpt2("gpt2-xl", 1600, 48, 25),
    _llama("llama2-7b", vocab=32000, dim=4096, layers=32, heads=32, kv=32, ffn=11008, ctx=4096, theta=1e4),
    _llama("llama2-13b", vocab=32000, dim=5120, layers=40, heads=40, kv=40, ffn=13824, ctx=4096, theta=1e4),
    _llama("llama2-70b", vocab=32000, dim=8192, layers=80, heads=64, kv=8, ffn=28672, ctx=4096, theta=1e4),
    _llama("llama3-8b", vocab=128256, dim=4096, layers=32, heads=32, kv=8, ffn=14336, ctx=131072, theta=5e5),
    _llama("llama3-70b", vocab=128256, dim=8192, layers=80, heads=64, kv=8, ffn=28672, ctx=131072, theta=5e5),
    _llama("llama3-405b", vocab=128256, dim=16384, layers=126, heads=128, kv=8, ffn=53248, ctx=131072, theta=5e5),
    ZooEntry(name="gpt-tiny", family="gpt", description="GPT 4L d64 (CPU tests and demo)",
             config=GPTConfig(vocab_size=512, max_seq_len=128, dim=64, n_layers=4, n_heads=4)),
    ZooEntry(name="gpt-tiny-untied", family="gpt", description="GPT 4L d64, head untied (CPU tests: vocabulary split)",
             config=GPTConfig(vocab_size=512, max_seq_len=128, dim=64, n_layers=4, n_heads=4, tie_embeddings=False)),
    ZooEntry(name="llama-tiny", family="llama", description="Llama 4L d64 4h/2kv (CPU tests and demo)",
             config=LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=128)),
    ZooEntry(name="gpt-wide", family="gpt", description="GPT 2L d256 (CPU fidelity suite: wide and shallow)",
             config=GPTConfig(vocab_size=512, max_seq_len=128, dim=256, n_layers=2, n_heads=4)),
    ZooEntry(name="gpt-embed", family="gpt", description="GPT 2L d64 vocab 16384 (CPU fidelity suite: embedding-heavy)",
             config=GPTConfig(vocab_size=16384, max_seq_len=128, dim=64, n_layers=2, n_heads=4)),
    _moe("mixtral-8x7b", "Mixtral 32L d4096 8 experts top-2 (meta: planning)", vocab_size=32000, dim=4096,
         n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336, expert_dim=14336, n_experts=8, top_k=2,
         max_seq_len=32768, rope_theta=1e6),
    _moe("qwen3-30b-a3b", "Qwen3-MoE 48L d2048 128 experts top-8 (meta: planning)", vocab_size=151936, dim=2048,
         n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, expert_dim=768, n_experts=128, top_k=8,
         max_seq_len=40960, qk_norm=True, norm_eps=1e-6, rope_theta=1e6),
    _moe("deepseek-v3", "DeepSeek-V3 61L d7168 MLA, 256 experts top-8 + 1 shared (meta: planning)",
         vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128, ffn_dim=18432,
         expert_dim=2048, n_experts=256, top_k=8, n_shared=1, first_dense=3, max_seq_len=163840, norm_eps=1e-6,
         mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128)),
    _moe("moe-tiny", "MoE 4L d64 8 experts top-2 + 1 shared, first block dense (CPU tests)", vocab_size=512, dim=64,
         n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=176, expert_dim=64, n_experts=8, top_k=2,
         n_shared=1, first_dense=1, max_seq_len=128),
    ZooEntry(name="mlp-deep", family="mlp", description="residual MLP 8L d64 (CPU tests, deep and narrow)",
             config=MLPConfig(in_dim=32, dim=64, hidden=256, n_layers=8, out_dim=32)),
]}


def build_zoo_model(entry: ZooEntry):
    """Instantiate the module for a zoo entry (on whatever device is current: use `with torch.device('meta')`)."""
    builders = {"gpt": GPT, "llama": Llama, "mlp": DeepMLP, "moe": MoETransformer}
    return builders[entry.family](entry.config)
